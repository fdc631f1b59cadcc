"""Job definitions and their schedule triggers: read here, and written by chimes.services.jobs, which
writes both in one transaction and decides what (quota, secrets, the first fire)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import datetime
from operator import attrgetter
from typing import Any

import asyncpg

from chimes.enums import Priority
from chimes.ids import partition_of
from chimes.jobs import AtScheduleSpec, CronScheduleSpec, IntervalScheduleSpec, JobSpec
from chimes.store.db import Conn, one_row
from chimes.store.queries import query, sql


@dataclass(frozen=True, slots=True)
class JobFilter:
    """Which jobs a list shows (``GET /jobs``): each given criterion must hold; None: any."""

    tag: str | None = None
    name_prefix: str | None = None  # case-sensitive: the job's name starts with it
    paused: bool | None = None
    kind: str | None = None  # "cron", "interval" or "at" (one-off)


@dataclass(frozen=True, slots=True)
class CreatedJob:
    job_id: uuid.UUID
    next_run_at: datetime | None
    created: bool
    version: int = 1


@dataclass(frozen=True, slots=True)
class JobColumns:
    """A job's definition as the columns of ``jobs``: the one list of them, from which insert_job and
    update_job name their columns and the bulk load its COPY (a field added here is written by all)."""

    name: str | None
    cron: str | None
    run_at: datetime | None
    timezone: str
    jitter_sec: int
    task: dict[str, Any]
    retry_policy: dict[str, Any]
    timeout_sec: int
    concurrency: str
    priority: int
    dst_gap: str | None
    dst_fold: str | None
    catch_up: dict[str, Any]
    queue_limit: int | None
    tags: list[str]
    notify_url: str | None
    start_deadline_sec: int | None
    pause_after_failures: int | None
    delete_after_completion: bool
    notify_on: list[str]
    every_sec: int | None
    phase_sec: int | None
    start_at: datetime | None
    end_at: datetime | None
    max_runs: int | None
    exclude_calendars: list[str] | None


SPEC_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(JobColumns))
#: A definition's values in the order of SPEC_COLUMNS.
spec_values: Callable[[JobColumns], tuple[Any, ...]] = attrgetter(*SPEC_COLUMNS)
_SPEC_SQL = {
    "spec_columns": ", ".join(SPEC_COLUMNS),
    "spec_values": ", ".join(f"${column}" for column in SPEC_COLUMNS),
    "spec_assignments": ", ".join(f"{column} = ${column}" for column in SPEC_COLUMNS),
}


@dataclass(frozen=True, slots=True)
class LastRun:
    """A job's newest run, by its scheduled time."""

    run_id: uuid.UUID
    status: str
    scheduled_at: datetime
    finished_at: datetime | None
    error: str | None


@dataclass(frozen=True, slots=True)
class JobRecord:
    job_id: uuid.UUID
    owner: str
    columns: JobColumns  # the definition as stored, sealed secrets as they are
    paused: bool
    version: int
    created_at: datetime
    updated_at: datetime
    next_run_at: datetime | None
    last_run: LastRun | None = None
    paused_at: datetime | None = None  # while paused: since when, by whom, why
    paused_by: str | None = None
    pause_note: str | None = None
    slots_fired: int = 0  # the slots recorded for its schedule, counted for schedule.maxRuns

    @property
    def remaining_runs(self) -> int | None:
        """The slots left to a job with a run cap (schedule.maxRuns); None without one."""
        cap = None if self.columns.run_at is not None else self.columns.max_runs
        return None if cap is None else max(0, cap - self.slots_fired)


def job_columns(spec: JobSpec) -> JobColumns:
    """The definition as the columns of ``jobs``."""
    wire = spec.to_wire()
    schedule = spec.schedule
    cron_spec = schedule if isinstance(schedule, CronScheduleSpec) else None
    interval = schedule if isinstance(schedule, IntervalScheduleSpec) else None
    recurring = None if isinstance(schedule, AtScheduleSpec) else schedule
    return JobColumns(
        name=spec.name,
        cron=cron_spec.cron if cron_spec else None,
        run_at=schedule.at if isinstance(schedule, AtScheduleSpec) else None,
        timezone=cron_spec.timezone if cron_spec else "UTC",
        jitter_sec=recurring.jitter_sec if recurring else 0,
        task=wire["task"],
        retry_policy=wire["retryPolicy"],
        timeout_sec=spec.timeout_sec,
        concurrency=spec.concurrency,
        priority=Priority.from_label(spec.priority),
        dst_gap=cron_spec.dst_gap if cron_spec else None,
        dst_fold=cron_spec.dst_fold if cron_spec else None,
        catch_up=wire["catchUp"],
        queue_limit=spec.queue_limit,
        tags=list(spec.tags),
        notify_url=spec.notify_url,
        start_deadline_sec=spec.start_deadline_sec,
        pause_after_failures=spec.pause_after_failures,
        delete_after_completion=spec.delete_after_completion,
        notify_on=list(spec.notify_on),
        every_sec=interval.every_sec if interval else None,
        phase_sec=interval.phase_sec if interval else None,
        start_at=recurring.start_at if recurring else None,
        end_at=recurring.end_at if recurring else None,
        max_runs=recurring.max_runs if recurring else None,
        exclude_calendars=recurring.exclude_calendars if recurring else None,
    )


def _spec_args(spec: JobSpec) -> dict[str, Any]:
    return dict(zip(SPEC_COLUMNS, spec_values(job_columns(spec)), strict=True))


def columns_of(row: asyncpg.Record) -> JobColumns:
    """A job's definition as its row has it (chimes.wire gives its wire form)."""
    return JobColumns(**{column: row[column] for column in SPEC_COLUMNS})


def _record(row: asyncpg.Record, last_run: LastRun | None = None) -> JobRecord:
    return JobRecord(
        job_id=row["job_id"], owner=row["owner"], columns=columns_of(row), paused=row["paused"],
        version=row["version"], created_at=row["created_at"], updated_at=row["updated_at"],
        next_run_at=row["next_run_at"], last_run=last_run, slots_fired=row.get("slots_fired") or 0,
        paused_at=row["paused_at"] if row["paused"] else None, paused_by=row["paused_by"], pause_note=row["pause_note"],
    )


@dataclass(frozen=True, slots=True)
class LockedJob:
    """A job's row, locked until the end of the caller's transaction."""

    job_id: uuid.UUID
    owner: str
    version: int
    paused: bool
    paused_at: datetime | None
    run_at: datetime | None  # a one-off job's time
    columns: JobColumns  # the definition as stored, sealed secrets as they are
    slots_fired: int = 0
    # A trigger kept by an earlier edit or pause, for the slots due up to carried_until (migration 0022)
    carried_until: datetime | None = None
    carried_slots: list[datetime] | None = None
    carried_unrecorded: int = 0


@dataclass(frozen=True, slots=True)
class ScheduleTriggers:
    """A job's schedule triggers, locked, and the database's clock read once they were."""

    now: datetime
    fire_ats: list[datetime]


@dataclass(frozen=True, slots=True)
class KeyedJob:
    """The job an Idempotency-Key made, and the fingerprint of the request that made it."""

    job: CreatedJob
    request_hash: bytes | None


class JobStore:
    """Read jobs, and write them within a transaction the caller holds (chimes.services.jobs decides
    what is written). ``owner=None`` means an admin: no ownership filter."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def get(self, job_id: uuid.UUID, owner: str | None) -> JobRecord | None:
        async with self._pool.acquire() as conn:
            row = await conn.fetchrow(sql("get_job"), job_id, owner)
            if row is None:
                return None
            last = await last_runs(conn, [job_id])
        return _record(row, last.get(job_id))

    async def list(self, owner: str | None, after: uuid.UUID | None, limit: int,
                   where: JobFilter | None = None) -> list[JobRecord]:
        f = where or JobFilter()
        criteria = (f.tag, f.name_prefix, f.paused, f.kind)
        async with self._pool.acquire() as conn:
            after = after or uuid.UUID(int=0)
            if owner is None:
                rows = await conn.fetch(sql("list_all_jobs"), after, limit, *criteria)
            else:
                rows = await conn.fetch(sql("list_jobs"), owner, after, limit, *criteria)
            last = await last_runs(conn, [r["job_id"] for r in rows])
        return [_record(r, last.get(r["job_id"])) for r in rows]


async def insert_job(conn: Conn, job_id: uuid.UUID, owner: str, spec: JobSpec,
                     idempotency_key: str | None, fingerprint: bytes | None) -> bool:
    """False when the owner used ``idempotency_key`` before: nothing is written then."""
    q = query("insert_job", **_SPEC_SQL)
    inserted = await conn.fetchval(q.text, *q.args({
        "job_id": job_id, "owner": owner, "idempotency_key": idempotency_key, "request_hash": fingerprint,
        **_spec_args(spec)}))
    return inserted is not None


async def job_of_key(conn: Conn, owner: str, idempotency_key: str) -> KeyedJob:
    existing = one_row(await conn.fetchrow(sql("job_by_idempotency_key"), owner, idempotency_key))
    job = one_row(await conn.fetchrow(sql("get_job"), existing["job_id"], owner))
    return KeyedJob(CreatedJob(job["job_id"], job["next_run_at"], created=False, version=job["version"]),
                    existing["request_hash"])


async def lock_job(conn: Conn, job_id: uuid.UUID, owner: str | None) -> LockedJob | None:
    row = await conn.fetchrow(sql("lock_job"), job_id, owner)
    if row is None:
        return None
    return LockedJob(job_id=row["job_id"], owner=row["owner"], version=row["version"], paused=row["paused"],
                     paused_at=row["paused_at"], run_at=row["run_at"], columns=columns_of(row),
                     slots_fired=row["slots_fired"] or 0, carried_until=row["carried_until"],
                     carried_slots=row["carried_slots"], carried_unrecorded=row["carried_unrecorded"] or 0)


@dataclass(frozen=True, slots=True)
class PauseRecord:
    """One pause of a job: when, by whom and why, and when and by whom it was resumed (still paused: None)."""

    paused_at: datetime
    paused_by: str
    note: str | None
    resumed_at: datetime | None
    resumed_by: str | None


async def count_nodes_before_releases(conn: Conn) -> int:
    """Live scheduler nodes of this database that record no release: 0.1.0 or earlier."""
    return int(await conn.fetchval(sql("count_nodes_before_releases")))


async def update_job(conn: Conn, job_id: uuid.UUID, spec: JobSpec, *, paused: bool, was_paused: bool,
                     actor: str, pause_note: str | None, moment: datetime | None = None) -> tuple[int, int]:
    """Rewrite the definition; returns the job's new version and the version of its plan (equal when
    the edit changed what a fire reads, migration 0022). A pause or a resume is recorded in the
    job's history of pauses with ``actor`` (and ``pause_note``, the reason a pause was given), at
    ``moment`` (the database's clock as the edit read it; its transaction's start when not given)."""
    q = query("update_job", **_SPEC_SQL)
    row = one_row(await conn.fetchrow(q.text, *q.args({
        "job_id": job_id, "paused": paused, "actor": actor, "pause_note": pause_note, "moment": moment,
        **_spec_args(spec)})))
    if paused and not was_paused:
        await record_pause(conn, job_id, actor, paused_at=row["paused_at"], note=pause_note)
    elif was_paused and not paused:
        await record_pause(conn, job_id, actor, resumed_at=row["resumed_at"])
    return int(row["version"]), int(row["plan_version"])


async def record_pause(conn: Conn, job_id: uuid.UUID, actor: str, *, paused_at: datetime | None = None,
                       note: str | None = None, resumed_at: datetime | None = None) -> None:
    """A pause that began at ``paused_at``, or (without it) the end of the open one at ``resumed_at``."""
    await conn.execute(sql("record_pause"), job_id, paused_at, actor, note, resumed_at)


async def pauses(pool: asyncpg.Pool, job_id: uuid.UUID, limit: int) -> list[PauseRecord]:
    return [PauseRecord(*row) for row in await pool.fetch(sql("job_pauses"), job_id, limit)]


async def insert_schedule_trigger(conn: Conn, job_id: uuid.UUID, fire_at: datetime,
                                  version: int) -> None:
    await conn.execute(sql("insert_schedule_trigger"), partition_of(job_id), fire_at, job_id, version)


async def lock_schedule_triggers(conn: Conn, job_id: uuid.UUID) -> ScheduleTriggers:
    """Lock the job's schedule triggers (after any fire of them under way) and read the clock."""
    await conn.fetch(sql("lock_schedule_triggers"), job_id)
    row = one_row(await conn.fetchrow(sql("schedule_triggers_now"), job_id))
    return ScheduleTriggers(now=row["now"], fire_ats=list(row["fire_ats"]))


async def set_carried(conn: Conn, job_id: uuid.UUID, until: datetime | None, slots: list[datetime] | None,
                      unrecorded: int | None) -> None:
    await conn.execute(sql("set_carried"), job_id, until, slots, unrecorded)


async def count_nodes_firing_by_version(conn: Conn) -> int:
    """Live scheduler nodes of releases before 0.3.4, which fire a trigger only at its job's version."""
    return int(await conn.fetchval(sql("count_nodes_firing_by_version")))


async def delete_schedule_triggers(conn: Conn, job_id: uuid.UUID) -> bool:
    """Whether the job had a schedule trigger."""
    status: str = await conn.execute(sql("delete_schedule_triggers"), job_id)
    return status != "DELETE 0"


async def track_unfinished_runs(conn: Conn, job_id: uuid.UUID) -> None:
    """Count the job's unfinished runs as active: it no longer allows runs to overlap."""
    await conn.execute(sql("track_unfinished_runs"), job_id)


async def delete_job(conn: Conn, job_id: uuid.UUID, owner: str | None) -> bool:
    """Delete the job and its triggers; False when not found."""
    deleted = await conn.fetchval(sql("delete_job"), job_id, owner)
    if deleted is not None:
        await delete_schedule_triggers(conn, job_id)
        await conn.execute(sql("delete_slot_count"), job_id)
    return deleted is not None


async def last_runs(conn: Conn, job_ids: list[uuid.UUID]) -> dict[uuid.UUID, LastRun]:
    if not job_ids:
        return {}
    rows = await conn.fetch(sql("last_runs"), job_ids)
    return {r["job_id"]: LastRun(run_id=r["run_id"], status=r["status"], scheduled_at=r["scheduled_at"],
                                 finished_at=r["finished_at"], error=r["error"])
            for r in rows}
