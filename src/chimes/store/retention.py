"""What retention asks of the database: old run-history partitions, dropped without stalling readers."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime

import asyncpg

from chimes.store import audit
from chimes.store.queries import sql


@dataclass(frozen=True, slots=True)
class OldDay:
    day: date
    tables: list[str]  # runs_YYYYMMDD and run_attempts_YYYYMMDD


class RetentionStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def old_days(self, cutoff: date) -> list[OldDay]:
        return [OldDay(r["day"], list(r["tables"])) for r in await self._pool.fetch(sql("old_run_partitions"), cutoff)]

    async def drop_day(self, day: OldDay, lock_timeout_sec: float) -> None:
        """Drop one day's partitions in one short transaction. Raises
        ``chimes.store.db.LockNotAvailable`` when a reader holds them past ``lock_timeout_sec``."""
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(sql("limit_lock_wait"), f"{max(1, round(lock_timeout_sec * 1000))}ms")
            await conn.execute(sql("lock_run_partitions"))
            await conn.execute(sql("drop_tables", tables=", ".join(_quoted(t) for t in day.tables)))

    async def delete_old_default_rows(self, cutoff: datetime, lock_timeout_sec: float) -> int:
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(sql("limit_lock_wait"), f"{max(1, round(lock_timeout_sec * 1000))}ms")
            deleted: int = await conn.fetchval(sql("delete_old_default_runs"), cutoff)
            return deleted

    async def delete_old_notifications(self, cutoff: datetime, batch: int) -> int:
        status = await self._pool.execute(sql("delete_old_notifications"), cutoff, batch)
        return int(status.split()[-1])


    async def delete_old_audit_entries(self, cutoff: datetime, batch: int) -> int:
        async with self._pool.acquire() as conn:
            return await audit.delete_older_than(conn, cutoff, batch)


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'
