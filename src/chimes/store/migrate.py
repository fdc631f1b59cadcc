"""Versioned schema migrations: numbered ``.sql`` files applied once each, in order, under a lock."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import resources

import asyncpg

from chimes.store.db import Conn
from chimes.store.queries import sql

log = logging.getLogger(__name__)

_LOCK_KEY = 0x43484D53  # "CHMS": one migrator at a time across every process
RUN_PARTITION_DAYS_AHEAD = 7


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str


def migrations() -> list[Migration]:
    folder = resources.files("chimes.store") / "migrations"
    found = []
    for entry in folder.iterdir():
        if entry.name.endswith(".sql"):
            number, _, rest = entry.name.partition("_")
            found.append(Migration(int(number), rest.removesuffix(".sql"), entry.read_text()))
    return sorted(found, key=lambda m: m.version)


async def migrate(conn: asyncpg.Connection) -> list[int]:
    """Apply every pending migration; return the versions applied. Safe to run from many processes."""
    await conn.execute(sql("lock_migrations"), _LOCK_KEY)
    try:
        await conn.execute(sql("create_schema_migrations"))
        done = {r["version"] for r in await conn.fetch(sql("applied_migrations"))}
        applied = []
        for migration in migrations():
            if migration.version in done:
                continue
            async with conn.transaction():
                await conn.execute(migration.sql)
                await conn.execute(sql("record_migration"), migration.version, migration.name)
            log.info("applied migration %04d_%s", migration.version, migration.name)
            applied.append(migration.version)
        await ensure_run_partitions(conn)
        return applied
    finally:
        if not conn.is_closed():  # a lost session has released its locks already
            await conn.execute(sql("unlock_migrations"), _LOCK_KEY)


async def ensure_run_partitions(conn: Conn | asyncpg.Pool, days_ahead: int = RUN_PARTITION_DAYS_AHEAD) -> int:
    """Create the run-history partitions from yesterday to ``days_ahead`` days from now."""
    created: int = await conn.fetchval(sql("ensure_run_partitions"), days_ahead + 2)
    return created
