"""What a worker asks of the database: claim runs, keep their leases, record their outcomes."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from chimes.store.queries import sql

QUEUE_CHANNEL = "chimes_run_queue"


@dataclass(frozen=True, slots=True)
class ClaimedRun:
    run_id: uuid.UUID
    scheduled_at: datetime
    job_id: uuid.UUID
    attempt: int
    lease_token: uuid.UUID
    started_at: datetime
    trigger: str
    task: dict[str, Any] | None
    retry_policy: dict[str, Any] | None
    timeout_sec: int | None
    job_exists: bool


@dataclass(frozen=True, slots=True)
class Outcome:
    """How an attempt ended. ``retry_at`` set: the run waits for another attempt then."""

    run: ClaimedRun
    status: str  # succeeded | failed | cancelled
    error: str | None
    output: str | None
    finished_at: datetime
    retry_at: datetime | None


class WorkerStore:
    def __init__(self, pool: asyncpg.Pool, worker_id: str) -> None:
        self._pool = pool
        self.worker_id = worker_id

    async def register(self, hostname: str, pid: int, concurrency: int, in_flight: int) -> None:
        await self._pool.execute(sql("register_worker"), self.worker_id, hostname, pid, concurrency, in_flight)

    async def forget(self) -> None:
        await self._pool.execute(sql("forget_worker"), self.worker_id)

    async def claim(self, limit: int, lease_sec: float, deadline_grace_sec: float) -> list[ClaimedRun]:
        rows = await self._pool.fetch(sql("claim_runs"), limit, self.worker_id, lease_sec, deadline_grace_sec)
        return [ClaimedRun(**dict(row)) for row in rows]

    async def extend_leases(self, runs: Sequence[ClaimedRun], lease_sec: float) -> set[uuid.UUID]:
        """Extend every held lease in one statement; returns the run ids still held."""
        if not runs:
            return set()
        rows = await self._pool.fetch(
            sql("extend_leases"), [r.run_id for r in runs], [r.scheduled_at for r in runs],
            [r.lease_token for r in runs], lease_sec,
        )
        return {row["run_id"] for row in rows}

    async def complete(self, outcomes: Sequence[Outcome]) -> set[uuid.UUID]:
        """Record a batch of outcomes in one statement; returns the runs whose outcome was accepted."""
        if not outcomes:
            return set()
        rows = await self._pool.fetch(
            sql("complete_runs"),
            [o.run.run_id for o in outcomes], [o.run.scheduled_at for o in outcomes],
            [o.run.lease_token for o in outcomes], [o.status for o in outcomes],
            [o.error for o in outcomes], [o.output for o in outcomes],
            [o.finished_at for o in outcomes], [o.retry_at for o in outcomes], self.worker_id,
        )
        return {row["run_id"] for row in rows}

    async def release(self, runs: Sequence[ClaimedRun]) -> set[uuid.UUID]:
        """Give runs back to the queue for another worker; returns the run ids handed back."""
        if not runs:
            return set()
        async with self._pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                sql("release_runs"), [r.run_id for r in runs], [r.scheduled_at for r in runs],
                [r.lease_token for r in runs],
            )
            await conn.execute("SELECT pg_notify($1, '')", QUEUE_CHANNEL)
        return {row["run_id"] for row in rows}
