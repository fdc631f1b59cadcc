"""Creating, changing and deleting jobs: the rules, with the store doing the reading and writing.

A job and its schedule trigger are written in one transaction, under the owner's row lock for a
create (so a quota holds exactly under concurrent creates) and the job's row lock for a change.
"""

from __future__ import annotations

import builtins
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from chimes import schedules, wire
from chimes.ids import new_job_id
from chimes.jobs import AtScheduleSpec, IntervalScheduleSpec, JobPatch, JobSpec
from chimes.security.refusals import JobQuotaExceeded, TaskNotAllowed
from chimes.security.secrets import (
    Keyring,
    default_keyring,
    has_secrets,
    keep_sealed,
    redact,
    seal_spec,
    split_sealed,
)
from chimes.slots import MAX_RECORDED, jitter_offset, walk
from chimes.store import jobs as job_store
from chimes.store.audit import AuditNote, record
from chimes.store.calendars import missing_calendars
from chimes.store.db import Conn, Pool, transaction
from chimes.store.jobs import CreatedJob, JobFilter, JobRecord, JobStore, LockedJob, PauseRecord, ScheduleTriggers
from chimes.store.owners import OwnerStore, count_jobs_up_to, lock_owner_for_job

#: Task types that run code on the worker's machine: only for owners the operator allowed.
COMMAND_TASK_TYPES = frozenset({"command", "container"})


class IdempotencyConflict(Exception):
    """The Idempotency-Key was already used by this owner for a different job definition."""


class UnknownCalendar(Exception):
    """schedule.excludeCalendars names calendars the owner does not have."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(f"unknown calendar {', '.join(repr(n) for n in names)}: create it first "
                         "(PUT /calendars/{name}, chimes calendars put)")
        self.names = names


async def _check_calendars(conn: Conn, owner: str, spec: JobSpec) -> None:
    names = None if isinstance(spec.schedule, AtScheduleSpec) else spec.schedule.exclude_calendars
    if names:
        missing = await missing_calendars(conn, owner, names)
        if missing:
            raise UnknownCalendar(missing)


class UpgradeInProgress(Exception):
    """Scheduler nodes of release 0.1.0 still fire this job's partitions and would misread it."""

    def __init__(self, feature: str, nodes: int) -> None:
        super().__init__(f"{feature} need every scheduler node at release 0.2.0 or later, and {nodes} of "
                         "release 0.1.0 still run: finish the upgrade first (docs/operations.md, \"Upgrades\")")


def _feature_old_nodes_misread(spec: JobSpec) -> str | None:
    """What of ``spec`` a scheduler node of release 0.1.0 would get wrong: it reads a job with neither
    cron nor run_at as a one-off that fires once, and ignores bounds, run caps and calendars."""
    schedule = spec.schedule
    if isinstance(schedule, AtScheduleSpec):
        return None
    if isinstance(schedule, IntervalScheduleSpec):
        return "interval schedules"
    if schedule.start_at or schedule.end_at or schedule.max_runs is not None or schedule.exclude_calendars:
        return "schedule.startAt, endAt, maxRuns and excludeCalendars"
    return None


async def _check_nodes_read(conn: Conn, spec: JobSpec) -> None:
    """During a rolling upgrade, refuse (and write nothing of) a job the older nodes still firing its
    home would fire wrongly; every other job is accepted as before."""
    feature = _feature_old_nodes_misread(spec)
    if feature is not None:
        nodes = await job_store.count_nodes_before_releases(conn)
        if nodes:
            raise UpgradeInProgress(feature, nodes)


class VersionMismatch(Exception):
    """A change was conditional on versions of the job (If-Match) that it no longer has."""

    def __init__(self, current: int) -> None:
        super().__init__(f"the job is at version {current}")
        self.current = current


def first_fire(spec: JobSpec, job_id: uuid.UUID, now: datetime, since: datetime | None = None,
               slots_fired: int = 0) -> datetime | None:
    """When a newly written (or resumed) definition fires first: its first slot after ``since``
    (the pause, when resuming) or ``now``, moved by the job's jitter; None once its schedule ended
    (past endAt, or ``slots_fired`` reached its maxRuns)."""
    if isinstance(spec.schedule, AtScheduleSpec):
        return spec.schedule.at
    if spec.schedule.max_runs is not None and slots_fired >= spec.schedule.max_runs:
        return None
    nominal = schedules.next_fire(spec.schedule.recurrence(), since or now)
    return None if nominal is None else nominal + jitter_offset(job_id, spec.schedule.jitter_sec)


#: Counts an owner's jobs on the homes other than a service's own, up to a limit (with shards); the
#: catalog's on the given connection (the one holding the owner's lock) when the service's home is a shard.
JobsElsewhere = Callable[[str, int, Conn | None], Awaitable[int]]


class JobService:
    """What the API and the dashboard do to jobs. ``owner=None`` means an admin: no ownership filter."""

    def __init__(self, pool: Pool, *, keyring: Keyring | None = None, default_job_quota: int | None = None,
                 catalog: Pool | None = None, jobs_elsewhere: JobsElsewhere | None = None) -> None:
        """With shards (docs/scaling.md, "Caps and quotas across shards"): ``pool`` is the job's home;
        ``catalog``, when that home is a shard, holds the owners; ``jobs_elsewhere`` counts an owner's
        jobs on the other homes, so that the quota holds across all of them."""
        self._pool = pool
        self._catalog = catalog
        self._jobs_elsewhere = jobs_elsewhere
        self.store = JobStore(pool)
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

    async def create(self, owner: str, spec: JobSpec, now: datetime, idempotency_key: str | None = None,
                     job_id: uuid.UUID | None = None, note: AuditNote | None = None) -> CreatedJob:
        """``job_id``: the new job's id when the caller chose it (to route it to its shard); ``note``: who
        asked, for the audit trail (an entry is written with the job, in its transaction)."""
        job_id = job_id or new_job_id()
        fingerprint = self._fingerprint(spec) if idempotency_key else None
        stored = seal_spec(spec, self._keyring) if has_secrets(spec) else spec
        async with contextlib.AsyncExitStack() as stack:
            # With shards, the owner's row in the catalog stays locked until the job's home committed:
            # creates for one owner count their jobs on every home one after the other. The other homes
            # are counted first, before the home's connection is taken: a create never holds a shard's
            # connection while it waits for another's, so a full pool cannot deadlock creates.
            if self._catalog is None:
                conn = await stack.enter_async_context(transaction(self._pool))
                quota = await self._admit(conn, owner, spec)
                await _check_calendars(conn, owner, spec)
                elsewhere = await self._count_elsewhere(owner, quota, None)
            else:
                owners = await stack.enter_async_context(transaction(self._catalog))
                quota = await self._admit(owners, owner, spec)
                await _check_calendars(owners, owner, spec)
                elsewhere = await self._count_elsewhere(owner, quota, owners)
                conn = await stack.enter_async_context(transaction(self._pool))
            await _check_nodes_read(conn, spec)
            if not await job_store.insert_job(conn, job_id, owner, stored, idempotency_key, fingerprint):
                assert idempotency_key is not None  # only a used key makes the insert write nothing
                keyed = await job_store.job_of_key(conn, owner, idempotency_key)
                if keyed.request_hash != fingerprint:  # the key was used before: answer with the job it created
                    raise IdempotencyConflict(idempotency_key)
                return keyed.job
            if quota is not None and elsewhere + await count_jobs_up_to(conn, owner, quota + 1 - elsewhere) > quota:
                raise JobQuotaExceeded(owner, quota)  # after the insert: the whole create is undone
            fire_at = first_fire(spec, job_id, now)
            if fire_at is not None:
                await job_store.insert_schedule_trigger(conn, job_id, fire_at, 1)
            if note is not None:
                await record(conn, note, "job.create", f"job {job_id}", None, _audited(stored.to_wire(), False),
                             job_id=job_id, subject_owner=owner, shown=redact)
        return CreatedJob(job_id, fire_at, created=True)

    async def _admit(self, conn: Conn, owner: str, spec: JobSpec) -> int | None:
        """Lock the owner's row (on ``conn``, the catalog's with shards), so concurrent creates count one
        after the other, refuse a task type the owner may not use, and return the quota that applies."""
        limits = await lock_owner_for_job(conn, owner)
        if spec.task.type in COMMAND_TASK_TYPES and not limits.allow_commands:
            raise TaskNotAllowed(owner, spec.task.type)
        return limits.job_quota if limits.job_quota is not None else self._default_job_quota

    async def _count_elsewhere(self, owner: str, quota: int | None, catalog: Conn | None) -> int:
        """The owner's jobs on the other homes (with shards), up to one past the quota; 0 without."""
        if quota is None or self._jobs_elsewhere is None:
            return 0
        return await self._jobs_elsewhere(owner, quota + 1, catalog)

    async def get(self, job_id: uuid.UUID, owner: str | None) -> JobRecord | None:
        return await self.store.get(job_id, owner)

    async def list(self, owner: str | None, after: uuid.UUID | None, limit: int,
                   where: JobFilter | None = None) -> list[JobRecord]:
        return await self.store.list(owner, after, limit, where)

    async def pauses(self, job_id: uuid.UUID, owner: str | None, limit: int) -> builtins.list[PauseRecord] | None:
        """The job's pauses, newest first; None when the job is not found (for this owner)."""
        if await self.store.get(job_id, owner) is None:
            return None
        return await job_store.pauses(self._pool, job_id, limit)

    async def update(self, job_id: uuid.UUID, owner: str | None, patch: JobPatch, now: datetime,
                     matching: frozenset[int] | None = None, note: AuditNote | None = None,
                     actor: str | None = None) -> JobRecord | None:
        """Apply a patch: bump the version and rewrite the trigger in the same transaction.

        ``actor``: who asks (a token's name, or its owner), recorded with a pause or a resume; the
        job's owner when not given.

        ``matching``: the versions the caller's change was made against (If-Match), None for any.
        Raises VersionMismatch when the job is at another version, and pydantic.ValidationError when
        the patched definition is invalid; nothing is written then.
        """
        async with self._catalog_first() as catalog, transaction(self._pool) as conn:
            job = await job_store.lock_job(conn, job_id, owner)
            if job is None:
                return None
            _check_version(job, matching)
            actor = actor or job.owner
            stored_before = wire.definition(job.columns)
            current, sealed = split_sealed(stored_before)
            previous = JobSpec.model_validate(current)
            spec = patch.apply_to(previous)
            if patch.task is None:
                stored = keep_sealed(spec, sealed)
            else:
                owners = OwnerStore(conn if self._catalog is None else self._catalog)
                if spec.task.type in COMMAND_TASK_TYPES and not await owners.allows_commands(job.owner):
                    raise TaskNotAllowed(job.owner, spec.task.type)
                stored = seal_spec(spec, self._keyring, sealed) if has_secrets(spec) else spec
            await _check_calendars(conn if catalog is None else catalog, job.owner, spec)
            await _check_nodes_read(conn, spec)
            paused = job.paused if patch.paused is None else patch.paused
            by_version = await job_store.count_nodes_firing_by_version(conn) > 0
            replan = by_version or _plan(previous, job.paused) != _plan(spec, paused)
            triggers = await job_store.lock_schedule_triggers(conn, job_id) if replan else None
            version, planned = await job_store.update_job(
                conn, job_id, stored, paused=paused, was_paused=job.paused, actor=actor, pause_note=patch.pause_note,
                moment=triggers.now if triggers else None)
            if triggers is None and planned == version:  # the database saw a change of plan after all
                triggers = await job_store.lock_schedule_triggers(conn, job_id)
            # Without a change of plan the trigger stays as it is and fires as planned.
            if triggers is not None:
                due = Carried() if by_version else carried_slots(job, previous, triggers)
                await _replan(conn, job, spec, paused=paused, version=version, triggers=triggers, due=due, now=now)
            if current.get("concurrency") == "allow" and spec.concurrency != "allow":
                await job_store.track_unfinished_runs(conn, job_id)
            if note is not None:
                before, after = _audited(_wire(stored_before), job.paused), _audited(stored.to_wire(), paused)
                if paused and not job.paused and patch.pause_note:
                    after["pauseNote"] = patch.pause_note  # why, beside who: "paused by ops-bot: incident 123"
                await record(conn, note, _update_action(before, after), f"job {job_id}", before, after,
                             job_id=job_id, subject_owner=job.owner, shown=redact)
        return await self.get(job_id, owner)

    @contextlib.asynccontextmanager
    async def _catalog_first(self) -> AsyncIterator[Conn | None]:
        """With shards, a transaction on the catalog, opened before the home's and ended after it: the
        calendars a change checks there stay locked (FOR SHARE) until the job naming them is committed,
        so a delete of one waits and then finds the job, as a create holds the owner's row. None
        without shards (the calendars are on the home's connection)."""
        if self._catalog is None:
            yield None
            return
        async with transaction(self._catalog) as catalog:
            yield catalog

    async def delete(self, job_id: uuid.UUID, owner: str | None, matching: frozenset[int] | None = None,
                     note: AuditNote | None = None) -> bool:
        """Delete the job and its triggers; False when not found. ``matching`` as for :meth:`update`."""
        async with transaction(self._pool) as conn:
            job = None
            if matching is not None or note is not None:
                job = await job_store.lock_job(conn, job_id, owner)
                if job is None:
                    return False
                _check_version(job, matching)
            deleted = await job_store.delete_job(conn, job_id, owner)
            if deleted and job is not None and note is not None:
                before = _audited(_wire(wire.definition(job.columns)), job.paused)
                await record(conn, note, "job.delete", f"job {job_id}", before, None, job_id=job_id,
                             subject_owner=job.owner, shown=redact)
            return deleted


def _audited(definition: dict[str, Any], paused: bool) -> dict[str, Any]:
    """A job's fields as the audit trail compares them: its definition (secrets as stored: sealed) and
    whether it is paused."""
    return {**definition, "paused": paused}


def _wire(definition: dict[str, Any]) -> dict[str, Any]:
    """A stored definition in the form a new one is written in (JobSpec's wire form, sealed values kept),
    so that comparing the two shows only what changed."""
    current, sealed = split_sealed(definition)
    return keep_sealed(JobSpec.model_validate(current), sealed).to_wire()


def _update_action(before: dict[str, Any], after: dict[str, Any]) -> str:
    """``job.pause`` and ``job.resume`` for a change of ``paused`` alone (a pause's note with it),
    ``job.update`` otherwise."""
    if {key for key in after if before.get(key) != after.get(key)} - {"pauseNote"} == {"paused"}:
        return "job.pause" if after["paused"] else "job.resume"
    return "job.update"


def _check_version(job: LockedJob, matching: frozenset[int] | None) -> None:
    if matching is not None and job.version not in matching:
        raise VersionMismatch(job.version)


@dataclass(frozen=True, slots=True)
class Carried:
    """The slots of a job's definition before an edit that were due and had not fired: the trigger kept
    for them fires at ``fire_at`` (the oldest of the due triggers, so its lateness shows)."""

    slots: list[datetime] = field(default_factory=list)
    unrecorded: int = 0
    fire_at: datetime | None = None


def _plan(spec: JobSpec, paused: bool) -> tuple[Any, ...]:
    """What a fire reads of a job: its schedule, catch-up policy, start deadline, concurrency policy and
    whether it is paused (the fields chimes_plan_version compares, migration 0022)."""
    wire = spec.to_wire()
    return (wire["schedule"], wire["catchUp"], spec.start_deadline_sec, spec.concurrency, paused)


def carried_slots(job: LockedJob, before: JobSpec, triggers: ScheduleTriggers) -> Carried:
    """The slots of ``before``, the definition being replaced, that were due at ``triggers.now`` and had
    not fired: the walk of its schedule from each due trigger up to that instant (a paused job's, up to
    its pause), or what an earlier edit kept. At most MAX_RECORDED, the older ones counted."""
    schedule = before.schedule
    recurrence = None if isinstance(schedule, AtScheduleSpec) else schedule.recurrence()
    offset = timedelta(0) if isinstance(schedule, AtScheduleSpec) else jitter_offset(job.job_id, schedule.jitter_sec)
    cap = None if isinstance(schedule, AtScheduleSpec) or schedule.max_runs is None else \
        max(schedule.max_runs - job.slots_fired, 0)
    policy = before.to_wire()["catchUp"]
    found: set[datetime] = set()
    unrecorded = 0
    due = [at for at in triggers.fire_ats if at <= triggers.now]
    for at in due:
        if job.carried_until is not None and at <= job.carried_until:  # kept by an earlier edit or pause
            if job.carried_slots is not None:
                found.update(job.carried_slots)
                unrecorded += job.carried_unrecorded
                continue
            until = job.carried_until
        elif job.paused:
            continue
        else:
            until = triggers.now
        walked = walk(recurrence, at - offset, until, policy, cap)
        found.update(walked.slots)
        unrecorded += walked.unrecorded
    slots = sorted(found)
    if len(slots) > MAX_RECORDED:
        unrecorded += len(slots) - MAX_RECORDED
        slots = slots[-MAX_RECORDED:]
    return Carried(slots, unrecorded, min(due) if slots else None)


async def _replan(conn: Conn, job: LockedJob, spec: JobSpec, *, paused: bool, version: int,
                  triggers: ScheduleTriggers, due: Carried, now: datetime) -> None:
    """Write a changed plan's triggers: the one kept for the slots ``due`` under the definition before
    (it fires them, late, and leaves no next trigger), and the first fire of the new definition after
    the edit. A one-off moved to another time moves its one run instead."""
    moved = (isinstance(spec.schedule, AtScheduleSpec) and job.run_at is not None
             and spec.schedule.at != job.run_at)
    await job_store.delete_schedule_triggers(conn, job.job_id)
    if due.slots and due.fire_at is not None and not moved:
        await job_store.insert_schedule_trigger(conn, job.job_id, due.fire_at, version)
        until = job.carried_until if job.paused else triggers.now
        await job_store.set_carried(conn, job.job_id, until, due.slots, due.unrecorded)
        counted = len(due.slots) + due.unrecorded
    else:
        await job_store.set_carried(conn, job.job_id, None, None, None)
        counted = 0
    if paused:
        return
    resuming = job.paused
    after = max(now, triggers.now) if counted else now
    fire_at = first_fire(spec, job.job_id, after, job.paused_at if resuming else None, job.slots_fired + counted)
    if fire_at is not None and not _one_off_done(spec, job, bool(triggers.fire_ats)):
        await job_store.insert_schedule_trigger(conn, job.job_id, fire_at, version)


def _one_off_done(spec: JobSpec, job: LockedJob, had_trigger: bool) -> bool:
    """A one-off job that already fired keeps no trigger unless the patch gives it a new time.

    (Firing its old slot again would be harmless, as the run id is taken, but it would show a
    ``nextRunAt`` that never comes.)
    """
    return (
        isinstance(spec.schedule, AtScheduleSpec)
        and spec.schedule.at == job.run_at
        and not had_trigger
        and not job.paused
    )
