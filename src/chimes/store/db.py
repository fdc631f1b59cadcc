"""Connecting to PostgreSQL: the pool every role uses, and the embedded server behind it by default."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import orjson

from chimes.settings import Settings
from chimes.store.embedded import EmbeddedPostgres

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


async def create_pool(dsn: str, *, min_size: int = 1, max_size: int = 10, **kwargs: Any) -> asyncpg.Pool:
    settings = {**SESSION_SETTINGS, **(kwargs.pop("server_settings", None) or {})}
    pool = await asyncpg.create_pool(
        dsn, min_size=min_size, max_size=max_size, init=_init_connection, server_settings=settings, **kwargs
    )
    assert pool is not None
    return pool


async def connect(dsn: str) -> asyncpg.Connection:
    conn = await asyncpg.connect(dsn, server_settings=SESSION_SETTINGS)
    await _init_connection(conn)
    return conn


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
