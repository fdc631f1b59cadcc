"""Run history for the API, and the runs the API starts (run now, re-run) or cancels."""

from __future__ import annotations

import uuid
from datetime import datetime

import asyncpg

from chimes.ids import partition_of, run_id_for, scheduled_at_of, truncate_to_millis
from chimes.store.queries import sql
from chimes.store.working import QUEUE_CHANNEL


class RunStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def job_visible(self, job_id: uuid.UUID, owner: str | None) -> bool:
        return await self._pool.fetchval(sql("job_owner"), job_id, owner) is not None

    async def list(
        self, job_id: uuid.UUID, owner: str | None, status: str | None,
        before: tuple[datetime, uuid.UUID] | None, limit: int,
    ) -> list[asyncpg.Record]:
        at, run_id = before if before else (None, None)
        return await self._pool.fetch(sql("list_runs"), job_id, owner, status, at, run_id, limit)

    async def get(self, run_id: uuid.UUID, owner: str | None) -> tuple[asyncpg.Record, list[asyncpg.Record]] | None:
        scheduled_at = scheduled_at_of(run_id)
        async with self._pool.acquire() as conn:
            run = await conn.fetchrow(sql("get_run"), run_id, scheduled_at, owner)
            if run is None:
                return None
            attempts = await conn.fetch(sql("run_attempts"), run_id, scheduled_at)
        return run, attempts

    async def start_now(self, job_id: uuid.UUID, owner: str | None, trigger: str, now: datetime) -> uuid.UUID | None:
        """Create and enqueue a run of the job at ``now``; None when the job does not exist (for this owner)."""
        scheduled_at = truncate_to_millis(now)
        run_id = run_id_for(job_id, scheduled_at)
        async with self._pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(
                sql("start_run_now"), job_id, owner, run_id, scheduled_at, partition_of(job_id), trigger
            )
            if not row["job_found"]:
                return None
            await conn.execute("SELECT pg_notify($1, '')", QUEUE_CHANNEL)
        return run_id

    async def cancel(self, run_id: uuid.UUID, owner: str | None, reason: str) -> bool:
        row = await self._pool.fetchrow(sql("cancel_run"), run_id, scheduled_at_of(run_id), owner, reason)
        return row is not None
