"""A process that starts while PostgreSQL is starting, recovering from a crash or restarting waits for
it instead of exiting (found by `chimes chaos`: nodes started during a crash recovery exited with
"the database system is starting up"); a wrong database still fails at once.

A real PostgreSQL cannot be held in its start-up state on demand without stopping the server every
other test uses, so a small front server on 127.0.0.1 answers the first connections exactly as a
starting PostgreSQL does (SQLSTATE 57P03 after the start-up packet), then passes bytes through to the
real one. To play a server that restarts just after a process connected, it can also cut the first
connections that send a given statement, as a restarting server closes every session.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit, urlunsplit

import asyncpg
import pytest

from chimes import failures, outage
from chimes.store import db

SSL_REQUEST = 80877103


def _starting_up_error() -> bytes:
    fields = b"SFATAL\0VFATAL\0C57P03\0Mthe database system is starting up\0\0"
    return b"E" + struct.pack("!I", len(fields) + 4) + fields


@dataclass
class FrontServer:
    """Refuses the first ``refuse`` connections as a starting PostgreSQL, forwards the rest; the first
    ``cuts`` of them that send ``cut_on`` are closed right there."""

    upstream_dsn: str
    refuse: int
    cut_on: bytes = b""
    cuts: int = 0
    connections: int = 0
    port: int = 0

    async def start(self) -> asyncio.Server:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        return server

    def dsn(self, database: str | None = None) -> str:
        parts = urlsplit(self.upstream_dsn)
        path = f"/{database}" if database else parts.path
        user = parts.username or "postgres"
        credentials = f"{user}:{parts.password}" if parts.password else user  # the embedded server's password
        return urlunsplit(("postgresql", f"{credentials}@127.0.0.1:{self.port}", path, "", ""))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            if self.connections <= self.refuse:
                await self._refuse(reader, writer)
            else:
                await self._forward(reader, writer)
        finally:
            writer.close()

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        length, code = struct.unpack("!II", await reader.readexactly(8))
        if code == SSL_REQUEST:
            writer.write(b"N")
            length = struct.unpack("!I", await reader.readexactly(4))[0]
            await reader.readexactly(length - 4)
        else:
            await reader.readexactly(length - 8)
        writer.write(_starting_up_error())
        await writer.drain()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await _open_upstream(self.upstream_dsn)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                if self.cuts and self.cut_on and self.cut_on in data:
                    self.cuts -= 1
                    writer.close()
                    up_writer.close()
                    return
                dst.write(data)
                await dst.drain()
            dst.close()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        except (ConnectionError, OSError):
            pass  # one side hung up mid-stream: the test's assertions say whether that mattered


async def _open_upstream(dsn: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(dsn)
    query = parse_qs(parts.query)
    host = query.get("host", [parts.hostname or "localhost"])[0]
    port = int(query.get("port", [parts.port or 5432])[0])
    if host.startswith("/"):
        return await asyncio.open_unix_connection(f"{host}/.s.PGSQL.{port}")
    return await asyncio.open_connection(host, port)


@pytest.fixture
async def front(database_url: str, request: pytest.FixtureRequest) -> AsyncIterator[FrontServer]:
    server_state = FrontServer(database_url, refuse=getattr(request, "param", 3))
    server = await server_state.start()
    try:
        yield server_state
    finally:
        server.close()


async def test_connect_waits_while_the_database_starts_up(front: FrontServer) -> None:
    conn = await db.connect(front.dsn(), wait_sec=30)
    try:
        assert await conn.fetchval("SELECT count(*) FROM jobs") == 0  # the real, migrated database
    finally:
        await conn.close()
    assert front.connections == 4  # three refusals, then the one that got through


async def test_pool_waits_while_the_database_starts_up(front: FrontServer) -> None:
    pool = await db.create_pool(front.dsn(), min_size=1, max_size=2, wait_sec=30)
    try:
        assert await pool.fetchval("SELECT 1") == 1
    finally:
        await pool.close()
    assert front.connections >= 4


@pytest.mark.parametrize("front", [1_000_000], indirect=True)
async def test_gives_up_after_the_wait(front: FrontServer) -> None:
    with pytest.raises(db.DatabaseUnavailable, match=r"starting up.*gave up after 0\.5 s") as raised:
        await db.connect(front.dsn(), wait_sec=0.5)
    assert isinstance(raised.value.__cause__, asyncpg.CannotConnectNowError)
    assert front.connections >= 2  # it did try again before giving up


@pytest.mark.parametrize("front", [0], indirect=True)
async def test_a_database_that_does_not_exist_fails_at_once(front: FrontServer) -> None:
    with pytest.raises(asyncpg.InvalidCatalogNameError):
        await db.connect(front.dsn("no_such_database"), wait_sec=30)
    assert front.connections == 1


async def _chimes(*args: str, database_url: str) -> tuple[int, str]:
    # The URL (with a password) goes in the environment: a command line is every local user's to read.
    env = {**os.environ, "CHIMES_LOG_FORMAT": "text", "CHIMES_DATABASE_URL": database_url}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "chimes", *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    return proc.returncode or 0, out.decode()


def _where(front: FrontServer) -> str:
    """The front server's database as messages name it: host, port and database name."""
    return f"127.0.0.1:{front.port}{urlsplit(front.dsn()).path}"


async def test_a_command_started_while_the_database_starts_up_goes_ahead(front: FrontServer) -> None:
    code, out = await _chimes("migrate", database_url=front.dsn())
    assert code == 0, out
    assert out.count(f"database catalog ({_where(front)}) not ready (CannotConnectNowError: the database system "
                     "is starting up)") == 3, out


@pytest.mark.parametrize("front", [1_000_000], indirect=True)
async def test_a_command_says_why_it_gave_up_waiting(front: FrontServer) -> None:
    code, out = await _chimes("migrate", "--database-wait", "0.5", database_url=front.dsn())
    assert code == 1
    assert out.splitlines()[-1] == (f"Error: the database catalog ({_where(front)}) is not accepting connections "
                                    "(CannotConnectNowError: the database system is starting up); gave up after "
                                    "0.5 s (--database-wait)")


@pytest.mark.parametrize("front", [0], indirect=True)
async def test_a_connection_lost_mid_statement_names_its_database(
    front: FrontServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The first failure of an outage is usually a statement on a connection that was open: the log line
    that says the database is unavailable names which one, here a shard, and where it is."""
    db.name_database(front.dsn(), "shard 3")
    front.cut_on, front.cuts = b"SELECT 'cut here'", 1
    pool = await db.create_pool(front.dsn(), min_size=1, max_size=1, wait_sec=5)
    try:
        with pytest.raises(db.DB_ERRORS) as raised:
            await pool.fetchval("SELECT 'cut here'")
    finally:
        await pool.close()
    assert outage.database_of(raised.value) == outage.Database("shard 3", f"shard 3 ({_where(front)})")
    caplog.set_level(logging.WARNING, logger="chimes.database")
    failures.loop_failed("worker", "claim", raised.value)
    [line] = [r.getMessage() for r in caplog.records if r.name == "chimes.database"]
    assert line.startswith(f"database unavailable: shard 3 ({_where(front)}): claim failed: "), line


async def test_a_restart_during_start_up_migrations_means_trying_again(front: FrontServer) -> None:
    front.refuse, front.cut_on, front.cuts = 0, b"pg_advisory_lock", 2
    code, out = await _chimes("migrate", database_url=front.dsn())
    assert code == 0, out
    assert out.count(f"database catalog ({_where(front)}) not ready (ConnectionDoesNotExistError: connection was "
                     "closed in the middle of operation)") == 2, out
    assert out.splitlines()[-1] == "schema is up to date"
    assert front.cuts == 0

