"""Connecting to PostgreSQL: the pool every role uses, and the embedded server behind it by default."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import orjson

from chimes.settings import Settings
from chimes.store.embedded import EmbeddedPostgres


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


async def _init_connection(conn: asyncpg.Connection) -> None:
    for type_name in ("json", "jsonb"):
        await conn.set_type_codec(type_name, encoder=_dumps, decoder=orjson.loads, schema="pg_catalog")


async def create_pool(dsn: str, *, min_size: int = 1, max_size: int = 10, **kwargs: Any) -> asyncpg.Pool:
    pool = await asyncpg.create_pool(
        dsn, min_size=min_size, max_size=max_size, init=_init_connection, **kwargs
    )
    assert pool is not None
    return pool


async def connect(dsn: str) -> asyncpg.Connection:
    conn = await asyncpg.connect(dsn)
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
