"""Where a benchmark runs: one PostgreSQL (the embedded one in a temporary folder, or ``--database-url``),
a fresh database per system under test, and a description of the machine for the report."""

from __future__ import annotations

import asyncio
import contextlib
import json
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
def environment(database_url: str | None, statements: bool = False, prefix: str = "bench") -> Iterator[Env]:
    """With ``statements`` (embedded server only), pg_stat_statements is loaded: a restart. ``prefix``
    names the databases made on the server, so that two benchmarks can share one."""
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
        yield Env(dsn, workdir, server, prefix=prefix, statements=statements and server is not None)
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


# What the server did during a measurement, read before and after it. pg_stat_wal and the table
# counters are flushed by each backend within a second of its last transaction; the WAL position is
# exact. Checkpoints: pg_stat_checkpointer (PostgreSQL 17 and later).
COUNTERS = """
SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0') AS lsn, w.wal_records, w.wal_fpi, d.blks_read, d.blks_hit,
       (SELECT coalesce(sum(coalesce(heap_blks_read, 0) + coalesce(idx_blks_read, 0)), 0)
        FROM pg_statio_user_tables WHERE relname = 'triggers') AS trigger_blks_read,
       (SELECT coalesce(sum(coalesce(heap_blks_hit, 0) + coalesce(idx_blks_hit, 0)), 0)
        FROM pg_statio_user_tables WHERE relname = 'triggers') AS trigger_blks_hit
FROM pg_stat_wal w, pg_stat_database d WHERE d.datname = current_database()
"""
CHECKPOINTS = "SELECT num_timed + num_requested AS checkpoints, num_done FROM pg_stat_checkpointer"
# Autovacuum and autoanalyze of each table: the server's background work that a burst sets off (the
# trigger table is vacuumed every 10,000 changes), counted as PostgreSQL's CPU. The times are
# PostgreSQL 18's; the counts alone before it.
AUTOVACUUM = """
SELECT coalesce(jsonb_object_agg(relname, jsonb_build_array(autovacuum_count + autoanalyze_count,
                                                            total_autovacuum_time + total_autoanalyze_time)),
                '{}') AS autovacuum,
       (SELECT count(*) FROM pg_stat_progress_vacuum) AS vacuums_running
FROM pg_stat_user_tables
"""
STATS_FLUSH_SEC = 1.5


async def server_counters(pool: asyncpg.Pool) -> dict[str, object]:
    await asyncio.sleep(STATS_FLUSH_SEC)  # the other backends' counters reach the shared stats
    async with pool.acquire() as conn:
        values: dict[str, object] = dict(await conn.fetchrow(COUNTERS))
        try:
            values.update(await conn.fetchrow(CHECKPOINTS))
        except asyncpg.UndefinedTableError:  # before PostgreSQL 17
            pass
        try:
            row = await conn.fetchrow(AUTOVACUUM)
            tables = row["autovacuum"]
            values["autovacuum"] = json.loads(tables) if isinstance(tables, str) else tables
            values["vacuums_running"] = row["vacuums_running"]
        except asyncpg.UndefinedColumnError:  # before PostgreSQL 18
            pass
    return values


def counters_since(before: dict[str, object], after: dict[str, object], fires: int) -> dict[str, object]:
    """Per fire: WAL bytes and records, full-page images, buffers read from outside the server's
    cache and found in it (all tables, and the trigger table alone); checkpoints begun meanwhile."""
    def per_fire(key: str, digits: int = 2) -> float:
        return round((float(after[key]) - float(before[key])) / fires, digits)  # type: ignore[arg-type]

    spent: dict[str, object] = {
        "wal_bytes_per_fire": round(per_fire("lsn", 1)), "wal_records_per_fire": per_fire("wal_records"),
        "full_page_images_per_fire": per_fire("wal_fpi", 3), "blocks_read_per_fire": per_fire("blks_read", 3),
        "blocks_hit_per_fire": per_fire("blks_hit", 1),
        "trigger_blocks_read_per_fire": per_fire("trigger_blks_read", 3),
        "trigger_blocks_hit_per_fire": per_fire("trigger_blks_hit", 1)}
    if "checkpoints" in after and "checkpoints" in before:
        spent["checkpoints_begun"] = int(after["checkpoints"]) - int(before["checkpoints"])  # type: ignore[call-overload]
    if "autovacuum" in after and "autovacuum" in before:
        earlier: dict[str, list[float]] = before["autovacuum"]  # type: ignore[assignment]
        later: dict[str, list[float]] = after["autovacuum"]  # type: ignore[assignment]
        spent["autovacuum"] = {
            table: {"runs": int(count - earlier.get(table, [0, 0])[0]),
                    "ms": round(ms - earlier.get(table, [0, 0])[1])}
            for table, (count, ms) in sorted(later.items()) if count > earlier.get(table, [0, 0])[0]}
        spent["vacuums_running_after"] = after["vacuums_running"]
    return spent


def describe_counters(spent: dict[str, object]) -> str:
    text = (f"per fire: WAL {spent['wal_bytes_per_fire']} bytes ({spent['wal_records_per_fire']} records, "
            f"{spent['full_page_images_per_fire']} full-page images), blocks read {spent['blocks_read_per_fire']} "
            f"(triggers {spent['trigger_blocks_read_per_fire']}), hit {spent['blocks_hit_per_fire']} "
            f"(triggers {spent['trigger_blocks_hit_per_fire']})")
    if "checkpoints_begun" in spent:
        text += f"; checkpoints begun: {spent['checkpoints_begun']}"
    if "autovacuum" in spent:
        done: dict[str, dict[str, int]] = spent["autovacuum"]  # type: ignore[assignment]
        text += "; autovacuum and autoanalyze done meanwhile: " + (
            ", ".join(f"{table} {v['runs']} ({v['ms']} ms)" for table, v in done.items()) or "none")
        text += f", still running at the end: {spent['vacuums_running_after']}"
    return text
