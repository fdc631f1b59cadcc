"""Where a benchmark runs: one PostgreSQL (the embedded one in a temporary folder, or ``--database-url``),
a fresh database per system under test, and a description of the machine for the report."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import psutil

from chimes.store.embedded import SERVER_SETTINGS, EmbeddedPostgres
from chimes.store.migrate import migrate


@dataclass
class Env:
    server_dsn: str
    workdir: Path
    embedded: EmbeddedPostgres | None
    prefix: str = "bench"  # of the databases made on the server
    statements: bool = False  # pg_stat_statements loaded: the cost of each statement is reported
    # A cluster's servers by role (primary, standby) and their postmasters' pids, read when asked
    servers: Callable[[], dict[str, int | None]] | None = None

    def database(self, system: str) -> str:
        return f"{self.prefix}_{system}"

    def dsn_of(self, database: str) -> str:
        parts = urlsplit(self.server_dsn)
        return urlunsplit((parts.scheme, parts.netloc, f"/{database}", parts.query, parts.fragment))

    def postmaster_pid(self) -> int | None:
        """The embedded server's main process (its CPU time is counted); None for an external server."""
        if self.embedded is None:
            return None
        pid_file = self.embedded.pgdata / "postmaster.pid"
        return int(pid_file.read_text().split()[0]) if pid_file.exists() else None

    def postmasters(self) -> dict[str, int | None]:
        """The servers whose CPU time is counted, by name: ``postgresql`` (the embedded one), or a
        cluster's ``primary`` and ``standby``."""
        if self.servers is not None:
            return self.servers()
        return {"postgresql": self.postmaster_pid()}


@contextlib.contextmanager
def environment(database_url: str | None, statements: bool = False) -> Iterator[Env]:
    """With ``statements`` (embedded server only), pg_stat_statements is loaded: a restart."""
    workdir = Path(tempfile.mkdtemp(prefix="chimes-bench-"))
    server = None
    try:
        if database_url is None:
            server = EmbeddedPostgres(workdir / "data")
            dsn = server.acquire()
            if statements:
                with (server.pgdata / "postgresql.conf").open("a") as conf:
                    conf.write("shared_preload_libraries = 'pg_stat_statements'\n")
                server.stop()
                server.acquire()
        else:
            dsn = database_url
        yield Env(dsn, workdir, server, statements=statements and server is not None)
    finally:
        if server is not None:
            server.release()
        shutil.rmtree(workdir, ignore_errors=True)


async def fresh_database(env: Env, name: str, *, chimes_schema: bool = False) -> str:
    """Drop and create database ``name`` on the server; with ``chimes_schema``, migrate it."""
    admin = await asyncpg.connect(env.server_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    dsn = env.dsn_of(name)
    if env.statements:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("CREATE EXTENSION pg_stat_statements")
            await conn.execute("SELECT pg_stat_statements_reset()")
        finally:
            await conn.close()
    if chimes_schema:
        conn = await asyncpg.connect(dsn)
        try:
            await migrate(conn)
        finally:
            await conn.close()
    return dsn


STATEMENT_COSTS = """
SELECT regexp_replace(left(query, 400), '\\s+', ' ', 'g') AS query, calls, rows,
       round(total_exec_time::numeric, 1) AS total_ms, round(mean_exec_time::numeric, 3) AS mean_ms,
       round(total_plan_time::numeric, 1) AS plan_ms
FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY total_exec_time DESC LIMIT $1
"""


async def statement_costs(env: Env, dsn: str, top: int = 12) -> list[dict[str, object]]:
    """The statements that took the database's time, most first (with ``--statements``)."""
    if not env.statements:
        return []
    conn = await asyncpg.connect(dsn)
    try:
        return [{k: float(v) if k.endswith("_ms") else v for k, v in r.items()}
                for r in await conn.fetch(STATEMENT_COSTS, top)]
    finally:
        await conn.close()


async def drop_database(env: Env, name: str) -> None:
    admin = await asyncpg.connect(env.server_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def describe_machine(env: Env) -> dict[str, object]:
    conn = await asyncpg.connect(env.server_dsn)
    try:
        version = await conn.fetchval("SHOW server_version")
    finally:
        await conn.close()
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "postgresql": version,
        "postgresql_settings": dict(SERVER_SETTINGS) if env.embedded else "external (--database-url)",
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()
