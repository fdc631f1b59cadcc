"""Operator settings kept in the database (``chimes config``), read by every role."""

from __future__ import annotations

from typing import Any

import asyncpg

from chimes.store.queries import sql


async def set_setting(conn: asyncpg.Connection | asyncpg.Pool, key: str, value: Any) -> None:
    """``value``: anything JSON can hold."""
    await conn.execute(sql("set_setting"), key, value)


async def delete_setting(conn: asyncpg.Connection | asyncpg.Pool, key: str) -> None:
    await conn.execute(sql("delete_setting"), key)
