"""Job definitions and their schedule triggers, always written together in one transaction."""

from __future__ import annotations

import builtins
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from chimes import cron
from chimes.enums import Priority
from chimes.ids import new_job_id, partition_of
from chimes.jobs import AtScheduleSpec, CronScheduleSpec, JobPatch, JobSpec
from chimes.security.secrets import Keyring, default_keyring, has_secrets, keep_sealed, seal_spec, split_sealed
from chimes.slots import jitter_offset
from chimes.store.db import Conn, one_row
from chimes.store.owners import admit_job, check_job_quota, check_task_allowed
from chimes.store.queries import sql


class IdempotencyConflict(Exception):
    """The Idempotency-Key was already used by this owner for a different job definition."""


class VersionMismatch(Exception):
    """A change was conditional on versions of the job (If-Match) that it no longer has."""

    def __init__(self, current: int) -> None:
        super().__init__(f"the job is at version {current}")
        self.current = current


def _check_version(row: asyncpg.Record, matching: frozenset[int] | None) -> None:
    if matching is not None and row["version"] not in matching:
        raise VersionMismatch(row["version"])


@dataclass(frozen=True, slots=True)
class JobRecord:
    job_id: uuid.UUID
    owner: str
    definition: dict[str, Any]  # the JobSpec in its wire form
    paused: bool
    version: int
    created_at: datetime
    updated_at: datetime
    next_run_at: datetime | None
    last_run: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class CreatedJob:
    job_id: uuid.UUID
    next_run_at: datetime | None
    created: bool
    version: int = 1


def first_fire(spec: JobSpec, job_id: uuid.UUID, now: datetime, since: datetime | None = None) -> datetime | None:
    """When a newly written (or resumed) definition fires first: its first slot after ``since``
    (the pause, when resuming) or ``now``, moved by the job's jitter."""
    if isinstance(spec.schedule, AtScheduleSpec):
        return spec.schedule.at
    nominal = cron.next_fire(spec.schedule.as_cron(), since or now)
    return None if nominal is None else nominal + jitter_offset(job_id, spec.schedule.jitter_sec)


def job_columns(spec: JobSpec) -> tuple[Any, ...]:
    """The definition as the columns of ``jobs``, in the order of JOB_COLUMNS (after owner)."""
    wire = spec.to_wire()
    schedule = spec.schedule
    cron_spec = schedule if isinstance(schedule, CronScheduleSpec) else None
    return (
        spec.name,
        cron_spec.cron if cron_spec else None,
        schedule.at if isinstance(schedule, AtScheduleSpec) else None,
        cron_spec.timezone if cron_spec else "UTC",
        cron_spec.jitter_sec if cron_spec else 0,
        wire["task"],
        wire["retryPolicy"],
        spec.timeout_sec,
        spec.concurrency,
        Priority.from_label(spec.priority),
        cron_spec.dst_gap if cron_spec else None,
        cron_spec.dst_fold if cron_spec else None,
        wire["catchUp"],
        spec.queue_limit,
        list(spec.tags),
        spec.notify_url,
        spec.start_deadline_sec,
    )


def definition_of(row: asyncpg.Record) -> dict[str, Any]:
    if row["cron"] is not None:
        schedule: dict[str, Any] = {"cron": row["cron"], "timezone": row["timezone"]}
        optional = {"jitterSec": row["jitter_sec"], "dstGap": row["dst_gap"], "dstFold": row["dst_fold"]}
        schedule.update((key, value) for key, value in optional.items() if value)
    else:
        schedule = {"at": row["run_at"]}
    definition = {
        "name": row["name"],
        "schedule": schedule,
        "task": row["task"],
        "retryPolicy": row["retry_policy"],
        "timeoutSec": row["timeout_sec"],
        "concurrency": row["concurrency"],
        "queueLimit": row["queue_limit"],
        "priority": Priority(row["priority"]).label,
        "catchUp": row["catch_up"],
        "tags": row["tags"],
        "startDeadlineSec": row["start_deadline_sec"],
    }
    if row["notify_url"]:
        definition["notifyUrl"] = row["notify_url"]
    return definition


def _record(row: asyncpg.Record, last_run: dict[str, Any] | None = None) -> JobRecord:
    return JobRecord(
        job_id=row["job_id"], owner=row["owner"], definition=definition_of(row), paused=row["paused"],
        version=row["version"], created_at=row["created_at"], updated_at=row["updated_at"],
        next_run_at=row["next_run_at"], last_run=last_run,
    )


class JobStore:
    """Create, read, change and delete jobs. ``owner=None`` means an admin: no ownership filter."""

    def __init__(self, pool: asyncpg.Pool, *, keyring: Keyring | None = None,
                 default_job_quota: int | None = None) -> None:
        self._pool = pool
        self._keyring_given = keyring
        self._default_job_quota = default_job_quota  # for owners without a quota of their own

    @property
    def _keyring(self) -> Keyring:
        # Loaded only when a secret is used, so a deployment without secrets needs no key.
        if self._keyring_given is None:
            self._keyring_given = default_keyring()
        return self._keyring_given

    def _fingerprint(self, spec: JobSpec) -> bytes:
        # Keyed when the definition holds secrets: a plain hash could be brute-forced back to them.
        plain = spec.fingerprint()
        return self._keyring.fingerprint(plain) if has_secrets(spec) else plain

    async def create(
        self, owner: str, spec: JobSpec, now: datetime, idempotency_key: str | None = None
    ) -> CreatedJob:
        job_id = new_job_id()
        fingerprint = self._fingerprint(spec) if idempotency_key else None
        stored = seal_spec(spec, self._keyring) if has_secrets(spec) else spec
        async with self._pool.acquire() as conn, conn.transaction():
            quota = await admit_job(conn, owner, spec, self._default_job_quota)
            inserted = await conn.fetchval(
                sql("insert_job"), job_id, owner, *job_columns(stored), idempotency_key, fingerprint
            )
            if inserted is None:  # the key was used before: answer with the job it created
                existing = one_row(await conn.fetchrow(sql("job_by_idempotency_key"), owner, idempotency_key))
                if existing["request_hash"] != fingerprint:
                    raise IdempotencyConflict(idempotency_key)
                job = one_row(await conn.fetchrow(sql("get_job"), existing["job_id"], owner))
                return CreatedJob(job["job_id"], job["next_run_at"], created=False, version=job["version"])
            await check_job_quota(conn, owner, quota)
            fire_at = first_fire(spec, job_id, now)
            if fire_at is not None:
                await conn.execute(sql("insert_schedule_trigger"), partition_of(job_id), fire_at, job_id, 1)
        return CreatedJob(job_id, fire_at, created=True)

    async def get(self, job_id: uuid.UUID, owner: str | None) -> JobRecord | None:
        async with self._pool.acquire() as conn:
            row = await conn.fetchrow(sql("get_job"), job_id, owner)
            if row is None:
                return None
            last = await self._last_runs(conn, [job_id])
        return _record(row, last.get(job_id))

    async def list(self, owner: str | None, after: uuid.UUID | None, limit: int) -> list[JobRecord]:
        async with self._pool.acquire() as conn:
            after = after or uuid.UUID(int=0)
            if owner is None:
                rows = await conn.fetch(sql("list_all_jobs"), after, limit)
            else:
                rows = await conn.fetch(sql("list_jobs"), owner, after, limit)
            last = await self._last_runs(conn, [r["job_id"] for r in rows])
        return [_record(r, last.get(r["job_id"])) for r in rows]

    async def update(self, job_id: uuid.UUID, owner: str | None, patch: JobPatch, now: datetime,
                     matching: frozenset[int] | None = None) -> JobRecord | None:
        """Apply a patch: bump the version and rewrite the trigger in the same transaction.

        ``matching``: the versions the caller's change was made against (If-Match), None for any.
        Raises VersionMismatch when the job is at another version, and pydantic.ValidationError when
        the patched definition is invalid; nothing is written then.
        """
        async with self._pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(sql("lock_job"), job_id, owner)
            if row is None:
                return None
            _check_version(row, matching)
            current, sealed = split_sealed(definition_of(row))
            spec = patch.apply_to(JobSpec.model_validate(current))
            if patch.task is None:
                stored = keep_sealed(spec, sealed)
            else:
                await check_task_allowed(conn, row["owner"], spec)
                stored = seal_spec(spec, self._keyring, sealed) if has_secrets(spec) else spec
            paused = row["paused"] if patch.paused is None else patch.paused
            version = await conn.fetchval(sql("update_job"), job_id, *job_columns(stored), paused)
            had_trigger = await conn.execute(sql("delete_schedule_triggers"), job_id) != "DELETE 0"
            resuming = row["paused"] and not paused
            fire_at = None if paused else first_fire(spec, job_id, now, row["paused_at"] if resuming else None)
            if fire_at is not None and not _one_off_done(spec, row, had_trigger):
                await conn.execute(sql("insert_schedule_trigger"), partition_of(job_id), fire_at, job_id, version)
        return await self.get(job_id, owner)

    async def delete(self, job_id: uuid.UUID, owner: str | None, matching: frozenset[int] | None = None) -> bool:
        """Delete the job and its triggers; False when not found. ``matching`` as for :meth:`update`."""
        async with self._pool.acquire() as conn, conn.transaction():
            if matching is not None:
                row = await conn.fetchrow(sql("lock_job"), job_id, owner)
                if row is None:
                    return False
                _check_version(row, matching)
            deleted = await conn.fetchval(sql("delete_job"), job_id, owner)
            if deleted is not None:
                await conn.execute(sql("delete_schedule_triggers"), job_id)
        return deleted is not None

    async def _last_runs(self, conn: Conn, job_ids: builtins.list[uuid.UUID]) -> dict[uuid.UUID, dict[str, Any]]:
        if not job_ids:
            return {}
        rows = await conn.fetch(sql("last_runs"), job_ids)
        return {
            r["job_id"]: {"runId": r["run_id"], "status": r["status"], "scheduledAt": r["scheduled_at"],
                          "finishedAt": r["finished_at"], "error": r["error"]}
            for r in rows
        }


def _one_off_done(spec: JobSpec, row: asyncpg.Record, had_trigger: bool) -> bool:
    """A one-off job that already fired keeps no trigger unless the patch gives it a new time.

    (Firing its old slot again would be harmless, as the run id is taken, but it would show a
    ``nextRunAt`` that never comes.)
    """
    return (
        isinstance(spec.schedule, AtScheduleSpec)
        and spec.schedule.at == row["run_at"]
        and not had_trigger
        and not row["paused"]
    )
