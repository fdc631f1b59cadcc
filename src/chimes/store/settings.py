"""Operator settings kept in the database (``chimes config``), read by every role."""

from __future__ import annotations

from typing import Any

import asyncpg

from chimes.store import db
from chimes.store.migrate import ensure_run_partitions
from chimes.store.queries import sql
from chimes.store.shards import copy_settings, load_map


async def set_setting(conn: asyncpg.Connection | asyncpg.Pool, key: str, value: Any) -> None:
    """``value``: anything JSON can hold."""
    await conn.execute(sql("set_setting"), key, value)


async def delete_setting(conn: asyncpg.Connection | asyncpg.Pool, key: str) -> None:
    await conn.execute(sql("delete_setting"), key)


async def change_everywhere(catalog: asyncpg.Connection, key: str, value: Any | None) -> None:
    """Set ``key`` to ``value`` (delete it for None) in the catalog, then copy the catalog's settings
    to every shard of its map: a notification is queued by a statement in its job's home, which reads
    the default webhook from that database. A shard that cannot be reached raises; running the
    command again copies what it missed."""
    if value is None:
        await delete_setting(catalog, key)
    else:
        await set_setting(catalog, key, value)
    # The day partitions of runs take a new `runs_fillfactor` at once, not at the next hourly check.
    await ensure_run_partitions(catalog)
    for url in (await load_map(catalog)).urls():
        await copy_settings(catalog, url)
        await db.with_connection(url, ensure_run_partitions)
