"""Connecting to PostgreSQL: the pool every role uses, and the embedded server behind it by default."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import asyncpg
import orjson

from chimes.settings import Settings
from chimes.store.embedded import EmbeddedPostgres

log = logging.getLogger("chimes.db")
T = TypeVar("T")

_JSONB_VERSION = b"\x01"  # the binary jsonb format is a version byte, then the JSON text


def _encode_jsonb(value: Any) -> bytes:
    return _JSONB_VERSION + orjson.dumps(value)


def _decode_jsonb(data: bytes) -> Any:
    return orjson.loads(data[1:])


async def _init_connection(conn: asyncpg.Connection) -> None:
    # Binary codecs: faster than text, and COPY (bulk import) needs them.
    await conn.set_type_codec("jsonb", encoder=_encode_jsonb, decoder=_decode_jsonb, schema="pg_catalog",
                              format="binary")
    await conn.set_type_codec("json", encoder=orjson.dumps, decoder=orjson.loads, schema="pg_catalog",
                              format="binary")


# The batch statements (fire, claim, complete, reap) take arrays of a few to a thousand rows. Only a
# custom plan sees their length; the generic plan PostgreSQL switches a prepared statement to after
# five executions guesses it: a 1,000-trigger fire took 400-600 ms instead of 50-90. Planning each
# time costs about 2 ms per batch.
SESSION_SETTINGS = {"plan_cache_mode": "force_custom_plan"}


def lock_holding_limit(seconds: float) -> dict[str, str]:
    """Server settings ending a session left idle inside a transaction for ``seconds``. A process that
    stalls there (a GC pause, SIGSTOP, a lost network) otherwise keeps its row locks, and the partitions
    or runs they guard, from everyone else until it wakes up (found by ``chimes chaos``)."""
    return {"idle_in_transaction_session_timeout": str(max(1, round(seconds * 1000)))}


# What a call can raise while the database restarts or the network drops; the roles' loops log it and
# try again. InternalClientError: a pooled connection the server dropped mid-operation (asyncpg#784).
DB_ERRORS = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError, TimeoutError)

# Errors of a server that is not accepting connections yet, or just now: starting, recovering from a
# crash, restarting (closing every session as it goes), or out of connection slots. A process starting
# meanwhile waits for it (up to CONNECT_WAIT_SEC) instead of exiting; a wrong password, database or URL
# still fails at once.
NOT_READY_ERRORS = (
    asyncpg.CannotConnectNowError,
    asyncpg.TooManyConnectionsError,
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    OSError,
    TimeoutError,
)
CONNECT_WAIT_SEC = 60.0


def set_connect_wait(seconds: float) -> None:
    """How long this process waits for a database that is not ready yet (``--database-wait``)."""
    global CONNECT_WAIT_SEC
    CONNECT_WAIT_SEC = seconds


class DatabaseUnavailable(ConnectionError):
    """The database did not accept a connection within the wait; the last error is the cause."""


async def when_ready(step: Callable[[], Awaitable[T]], wait_sec: float | None = None) -> T:
    """Run ``step`` until the database lets it through, trying again from the start while the server is
    not ready, for up to ``wait_sec`` (default: ``--database-wait``). The step must be safe to repeat."""
    wait = CONNECT_WAIT_SEC if wait_sec is None else wait_sec
    deadline = time.monotonic() + wait
    pause = 0.1
    while True:
        try:
            return await step()
        except NOT_READY_ERRORS as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DatabaseUnavailable(
                    f"the database is not accepting connections ({type(exc).__name__}: {exc}); gave up after "
                    f"{wait:g} s (--database-wait)") from exc
            log.warning("database not ready (%s: %s); trying again for up to %.0f s", type(exc).__name__, exc, left)
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, 2.0)


async def create_pool(dsn: str, *, min_size: int = 1, max_size: int = 10, wait_sec: float | None = None,
                      **kwargs: Any) -> asyncpg.Pool:
    """A pool of connections set up for Chimes; waits for a database that is not ready yet."""
    settings = {**SESSION_SETTINGS, **(kwargs.pop("server_settings", None) or {})}

    async def open_pool() -> asyncpg.Pool:
        pool = await asyncpg.create_pool(
            dsn, min_size=min_size, max_size=max_size, init=_init_connection, server_settings=settings, **kwargs
        )
        assert pool is not None
        return pool

    return await when_ready(open_pool, wait_sec)


async def _open_connection(dsn: str) -> asyncpg.Connection:
    conn = await asyncpg.connect(dsn, server_settings=SESSION_SETTINGS)
    await _init_connection(conn)
    return conn


async def connect(dsn: str, *, wait_sec: float | None = None) -> asyncpg.Connection:
    return await when_ready(lambda: _open_connection(dsn), wait_sec)


async def with_connection(dsn: str, step: Callable[[asyncpg.Connection], Awaitable[T]], *,
                          wait_sec: float | None = None) -> T:
    """Run ``step`` on a connection of its own, closed after. A server that goes away in the middle
    (restarting, crashing) means a fresh connection and the step from the start, within the wait: what
    a process does on start-up must not make it exit when the database restarts at that moment (found
    by ``chimes chaos``). The step must be safe to repeat: one transaction, or work that checks first."""
    async def once() -> T:
        conn = await _open_connection(dsn)
        try:
            return await step(conn)
        finally:
            if not conn.is_closed():
                await conn.close()

    return await when_ready(once, wait_sec)


@contextlib.contextmanager
def database_url(settings: Settings) -> Any:
    """Yield the DSN to use: the configured URL, or the embedded server (started and shared as needed)."""
    if settings.database_url is not None:
        yield settings.database_url
        return
    server = EmbeddedPostgres(settings.data_dir)
    dsn = server.acquire()
    try:
        yield dsn
    finally:
        server.release()


@contextlib.asynccontextmanager
async def transaction(pool: asyncpg.Pool) -> AsyncIterator[asyncpg.Connection]:
    async with pool.acquire() as conn, conn.transaction():
        yield conn
