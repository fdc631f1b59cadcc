"""What the schedule health check (chimes.scheduler.health) reads and writes: overdue triggers, late
runs, schedules without a trigger, runs holding a schedule, and the stalls and notifications it
records. The judging is the check's; this module only reads and writes."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from chimes.store.queries import sql


@dataclass(frozen=True, slots=True)
class OverdueTrigger:
    """A trigger not fired well after it was due, with its job's schedule."""

    partition_id: int
    fire_at: datetime
    trigger_id: uuid.UUID
    job_id: uuid.UUID
    owner: str
    cron: str | None  # None: a one-off job
    timezone: str
    dst_gap: str | None
    dst_fold: str | None
    jitter_sec: int
    start_deadline_sec: int
    every_sec: int | None  # an interval job's (cron and every_sec both None: a one-off job)
    leased: bool  # its partition has a live owner: the fleet is behind, rather than absent

    @property
    def recurring(self) -> bool:
        return self.cron is not None or self.every_sec is not None


@dataclass(frozen=True, slots=True)
class LateRun:
    """A run not started by its job's start deadline."""

    run_id: uuid.UUID
    scheduled_at: datetime
    fired_at: datetime | None
    enqueued_at: datetime | None
    start_deadline_sec: int


@dataclass(frozen=True, slots=True)
class UntriggeredSchedule:
    """A recurring, active job whose schedule trigger is gone, with its last fire."""

    job_id: uuid.UUID
    owner: str
    cron: str | None  # None: an interval job
    timezone: str
    dst_gap: str | None
    dst_fold: str | None
    every_sec: int | None
    phase_sec: int | None
    start_at: datetime | None
    end_at: datetime | None
    last_fire: datetime


@dataclass(frozen=True, slots=True)
class BlockingRun:
    """An unfinished run holding back a recurring job whose concurrency is skip or queue."""

    run_id: uuid.UUID
    scheduled_at: datetime
    job_id: uuid.UUID
    owner: str
    since: datetime  # started, or scheduled when not started yet
    cron: str | None  # None: an interval job
    timezone: str
    dst_gap: str | None
    dst_fold: str | None
    every_sec: int | None
    phase_sec: int | None
    start_at: datetime | None
    end_at: datetime | None


@dataclass(frozen=True, slots=True)
class StallRecord:
    job_id: uuid.UUID
    owner: str
    cause: str  # overdue | no_trigger | held
    since: datetime
    detail: str
    fire_at: datetime | None
    run_id: uuid.UUID | None


class HealthStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def overdue_triggers(self, overdue_sec: float, per_partition: int) -> list[OverdueTrigger]:
        rows = await self._pool.fetch(sql("overdue_triggers"), overdue_sec, per_partition)
        return [OverdueTrigger(**dict(row)) for row in rows]

    async def late_unstarted_runs(self, limit: int) -> list[LateRun]:
        return [LateRun(**dict(row)) for row in await self._pool.fetch(sql("late_unstarted_runs"), limit)]

    async def job_sweep_end(self, after: uuid.UUID, jobs: int) -> uuid.UUID | None:
        """The last of the next ``jobs`` job ids after ``after``; None past the last job."""
        end: uuid.UUID | None = await self._pool.fetchval(sql("job_sweep_end"), after, jobs)
        return end

    async def schedules_without_trigger(self, after: uuid.UUID, through: uuid.UUID) -> list[UntriggeredSchedule]:
        rows = await self._pool.fetch(sql("schedules_without_trigger"), after, through)
        return [UntriggeredSchedule(**dict(row)) for row in rows]

    async def blocking_runs(self, older_than_sec: float) -> list[BlockingRun]:
        return [BlockingRun(**dict(row)) for row in await self._pool.fetch(sql("blocking_runs"), older_than_sec)]

    async def record_stalls(self, stalls: Sequence[StallRecord]) -> None:
        """Forget the incidents that are over and record the new ones, in one transaction."""
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.fetch(sql("resolve_stalls"))
            await conn.execute(sql("record_stalls"), [s.job_id for s in stalls], [s.owner for s in stalls],
                               [s.cause for s in stalls], [s.since for s in stalls], [s.detail for s in stalls],
                               [s.fire_at for s in stalls], [s.run_id for s in stalls])

    async def notify_runs(self, kind: str, run_ids: Sequence[uuid.UUID], scheduled_at: Sequence[datetime],
                          details: Sequence[str]) -> int:
        """Queue one notification per run (once per run and kind); returns how many were queued."""
        queued: int = await self._pool.fetchval(sql("notify_runs"), kind, run_ids, scheduled_at, details)
        return queued

    async def notify_jobs(self, kind: str, job_ids: Sequence[uuid.UUID], incidents: Sequence[str],
                          details: Sequence[str], scheduled_at: Sequence[datetime | None],
                          run_ids: Sequence[uuid.UUID | None]) -> int:
        """Queue one notification per job and incident (once each); returns how many were queued."""
        queued: int = await self._pool.fetchval(sql("notify_jobs"), kind, job_ids, incidents, details, scheduled_at,
                                                run_ids)
        return queued
