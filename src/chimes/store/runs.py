"""Run history for the API, and the runs the API starts (run now, re-run) or cancels."""

from __future__ import annotations

import builtins
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from chimes.backoff import plan_retry
from chimes.calendars import Calendar, first_excluding
from chimes.enums import RunStatus, RunTrigger
from chimes.ids import (
    new_run_id,
    partition_of,
    run_id_for,
    scheduled_at_of,
    scheduled_at_of_or_none,
    truncate_to_millis,
)
from chimes.schedules import fire_times, recurrence_of
from chimes.store.audit import AuditNote, record
from chimes.store.db import Row, one_row
from chimes.store.queries import bind, sql
from chimes.store.working import ANY_OWNER, queued_payload, runs_ended


class BackfillError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class RunDetail:
    """One run with its ended attempts. ``run`` and ``attempts`` are the rows as read, for rendering
    (chimes.api.views.run_view, the dashboard's run page); decisions use the typed fields."""

    run_id: uuid.UUID
    job_id: uuid.UUID
    status: str
    run: Row
    attempts: list[Row]


@dataclass(frozen=True, slots=True)
class BackfillResult:
    created: list[uuid.UUID]  # the runs queued
    existing: int  # slots that had a run already
    skipped: int = 0  # slots recorded as skipped: a calendar the job names excludes them


#: The owner's calendars by these names, as the scheduler asks them (chimes.store.calendars.calendars_named:
#: with shards they live in the catalog, not in the job's home).
CalendarLookup = Callable[[str, Sequence[str]], Awaitable[Sequence[Calendar]]]


class RunStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def job_visible(self, job_id: uuid.UUID, owner: str | None) -> bool:
        return await self._pool.fetchval(sql("job_owner"), job_id, owner) is not None

    async def history_visible(self, job_id: uuid.UUID, owner: str | None) -> bool:
        """Whether runs of the job (existing or deleted) are kept and visible to ``owner``."""
        return await self._pool.fetchval(sql("history_owner"), job_id, owner) is not None

    async def list(
        self, job_id: uuid.UUID, owner: str | None, status: str | None,
        before: tuple[datetime, uuid.UUID] | None, limit: int,
    ) -> list[asyncpg.Record]:
        at, run_id = before if before else (None, None)
        return await self._pool.fetch(sql("list_runs"), job_id, owner, status, at, run_id, limit)

    async def run_partition(self, run_id: uuid.UUID) -> int | None:
        """The run's partition if this database holds the run, else None (with shards, the API asks
        each: chimes.api.homes)."""
        scheduled_at = scheduled_at_of_or_none(run_id)
        if scheduled_at is None:
            return None
        found: int | None = await self._pool.fetchval(sql("run_partition"), run_id, scheduled_at)
        return found

    async def get(self, run_id: uuid.UUID, owner: str | None) -> RunDetail | None:
        scheduled_at = scheduled_at_of(run_id)
        async with self._pool.acquire() as conn:
            run = await conn.fetchrow(sql("get_run"), run_id, scheduled_at, owner)
            if run is None:
                return None
            attempts = await conn.fetch(sql("run_attempts"), run_id, scheduled_at)
        return RunDetail(run["run_id"], run["job_id"], run["status"], run, list(attempts))

    async def start_now(self, job_id: uuid.UUID, owner: str | None, trigger: str, now: datetime,
                        note: AuditNote | None = None) -> uuid.UUID | None:
        """Create and enqueue a run of the job at ``now``, with an id of its own (each call is one more
        run, even two in the same millisecond); None when the job does not exist (for this owner)."""
        scheduled_at = truncate_to_millis(now)
        run_id = new_run_id(scheduled_at)
        async with self._pool.acquire() as conn, conn.transaction():
            row = one_row(await conn.fetchrow(
                sql("start_run_now"), job_id, owner, run_id, scheduled_at, partition_of(job_id), trigger
            ))
            if not row["job_found"]:
                return None
            await conn.execute(sql("notify_queue"), queued_payload([row["owner"]]))
            if note is not None:
                action = "run.rerun" if trigger == RunTrigger.RERUN else "run.trigger"
                await record(conn, note, action, f"run {run_id}", None,
                             {"runId": str(run_id), "trigger": str(trigger), "status": "scheduled"}, job_id=job_id)
        return run_id

    async def backfill(self, job_id: uuid.UUID, owner: str | None, start: datetime, end: datetime,
                       limit: int, note: AuditNote | None = None,
                       calendars: CalendarLookup | None = None) -> BackfillResult | None:
        """Create the runs the job's schedule implies in (start, end], at most ``limit`` slots;
        slots that already have a run are left as they are, and slots the calendars the job names
        exclude are recorded as skipped, naming the calendar, as the scheduler records them (without
        ``calendars``, every slot of a job that names any: they fail closed). None when the job is
        not found."""
        # Read, and the calendars looked up, before the transaction: no connection is held while
        # another is asked for (with one database, from the same pool).
        job = await self._pool.fetchrow(sql("job_for_backfill"), job_id, owner)
        if job is None:
            return None
        schedule = recurrence_of(job["cron"], job["timezone"], dst_gap=job["dst_gap"], dst_fold=job["dst_fold"],
                                 every_sec=job["every_sec"], phase_sec=job["phase_sec"], start_at=job["start_at"],
                                 end_at=job["end_at"])
        if schedule is None:
            raise BackfillError("schedule", "backfill needs a recurring (cron or interval) schedule")
        slots = fire_times(schedule, start, end, limit + 1)
        if len(slots) > limit:
            raise BackfillError("end", f"the range holds more than {limit} fires; backfill it in parts")
        names = job["exclude_calendars"] or []
        excluding = list(await calendars(job["owner"], names) if calendars is not None else
                         [Calendar.unusable(name, "not read") for name in names])
        skipped_because = [None if (by := first_excluding(excluding, s)) is None else f"{by.reason} (backfill)"
                           for s in slots]
        run_ids = [run_id_for(job_id, s) for s in slots]
        async with self._pool.acquire() as conn, conn.transaction():
            if await conn.fetchrow(sql("job_for_backfill"), job_id, owner) is None:
                return None  # deleted meanwhile
            made = await conn.fetch(sql("backfill_runs"), job_id, run_ids, slots, partition_of(job_id),
                                    skipped_because)
            created = [r["run_id"] for r in made if not r["skipped"]]
            if created:
                await conn.execute(sql("notify_queue"), ANY_OWNER)
            result = BackfillResult(created, len(slots) - len(made), len(made) - len(created))
            if note is not None:
                await record(conn, note, "job.backfill", f"job {job_id}", None,
                             {"start": start.isoformat(), "end": end.isoformat(), "created": len(result.created),
                              "existing": result.existing, "skipped": result.skipped}, job_id=job_id)
        return result

    async def callback_heartbeat(self, run_id: uuid.UUID, owner: str | None, lease_token: uuid.UUID,
                                 lease_sec: float) -> datetime | None:
        """Extend the lease of a run whose target reports for itself; None when the token is stale."""
        args = (run_id, scheduled_at_of(run_id), owner, lease_token, lease_sec)
        async with self._pool.acquire() as conn, conn.transaction():
            expires_at: datetime | None = await conn.fetchval(sql("callback_heartbeat"), *args)
            if expires_at is None:  # its first heartbeat: the run's lease was its claim's
                expires_at = await conn.fetchval(sql("callback_own_lease"), *args)
        return expires_at

    async def callback_complete(self, run_id: uuid.UUID, owner: str | None, lease_token: uuid.UUID, status: str,
                                error: str | None, output: str | None, now: datetime) -> bool:
        """Record the outcome a target reported, exactly as a worker would: conditional on the lease
        token, a failure with attempts left waits for its retry. False when the token is stale."""
        scheduled_at = scheduled_at_of(run_id)
        async with self._pool.acquire() as conn, conn.transaction():
            run = await conn.fetchrow(sql("running_with_token"), run_id, scheduled_at, owner, lease_token)
            if run is None:
                return False
            retry_at = None
            if status == RunStatus.FAILED:
                retry = plan_retry(run["retry_policy"], run["attempt"], now, since=scheduled_at)
                retry_at = retry.at
                if retry.past_deadline:
                    error = f"{error}; {retry.past_deadline}" if error else retry.past_deadline
            text, args = bind("complete_runs", outcome_run_id=[run_id], outcome_scheduled_at=[scheduled_at],
                              outcome_lease_token=[lease_token], outcome_status=[status], outcome_error=[error],
                              outcome_output=[output], outcome_finished_at=[now], outcome_retry_at=[retry_at],
                              worker_id="callback", forget_claims=[])
            ended = await conn.fetch(text, *args)
            await runs_ended(conn, [r for r in ended if r["final"]])
        return bool(ended)

    async def queue_depth(self) -> builtins.list[asyncpg.Record]:
        return await self._pool.fetch(sql("queue_depth"))

    async def cancel(self, run_id: uuid.UUID, owner: str | None, reason: str, note: AuditNote | None = None) -> bool:
        async with self._pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(sql("cancel_run"), run_id, scheduled_at_of(run_id), owner, reason)
            if row is not None:
                if note is not None:
                    was = RunStatus.RUNNING if row["was_running"] else RunStatus.SCHEDULED
                    await record(conn, note, "run.cancel", f"run {run_id}", {"status": str(was)},
                                 {"status": "cancelled", "reason": reason}, job_id=row["job_id"])
                await runs_ended(conn, [row])
                if row["was_running"]:  # delivered at commit: its worker stops the attempt at once
                    await conn.execute(sql("notify_cancel"), str(run_id))
        return row is not None
