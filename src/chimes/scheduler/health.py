"""Schedule health: the dead man's switch, and runs that miss their start deadline.

Both end in the same notification outbox as a final failure.

A *stalled schedule* is a recurring, active job whose last fire is older than its period plus a
grace, whatever the cause; each sweep looks for the three there are:

- ``overdue``: its trigger is due more than the grace ago and was not fired (its partition has no
  live owner, or the fleet is behind): one short index range per partition, at most
  ``OVERDUE_PER_PARTITION`` each;
- ``no_trigger``: its trigger row is gone; found by a bounded sweep over the jobs in id order,
  ``JOBS_PER_SWEEP`` a sweep, so a full pass over 10 million jobs takes 10,000,000 / 20,000 sweeps of
  10 s, about 80 minutes, each sweep an index-only range of ``jobs`` and one ``triggers_job_kind``
  lookup per job;
- ``held``: a run has been holding a skip or queue schedule (from ``active_runs``, the unfinished
  runs).

A stall is notified once per incident (the incident is its overdue trigger, its last fire, or the
holding run) and recorded in ``schedule_stalls`` for the dashboard until it is over.

A *missed start* is a run not started by its job's start deadline after its scheduled time: waiting
in the queue, never enqueued (its trigger overdue), or fired late (the fire notices that itself,
:meth:`chimes.store.scheduling.SchedulerStore.fire`). Each is notified once per run.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from chimes import schedules
from chimes.ids import run_id_for, scheduled_at_of
from chimes.slots import jitter_offset
from chimes.store.db import Pool
from chimes.store.health import BlockingRun, HealthStore, OverdueTrigger, StallRecord, UntriggeredSchedule

log = logging.getLogger(__name__)

GRACE = timedelta(seconds=60)
UNSTARTED_LOOKED_AT = 1000  # unstarted runs looked at per sweep: the oldest, which are the first to be late
OVERDUE_PER_PARTITION = 10
JOBS_PER_SWEEP = 20_000
_BEFORE_ALL_IDS = uuid.UUID(int=0)


def interval_of(schedule: schedules.Recurrence, around: datetime) -> timedelta | None:
    """The gap between two fires of the schedule after ``around``; None once it ends."""
    first = schedules.next_fire(schedule, around)
    second = schedules.next_fire(schedule, first) if first is not None else None
    return None if first is None or second is None else second - first


def stalled(since: datetime, schedule: schedules.Recurrence | None, now: datetime, grace: timedelta = GRACE) -> bool:
    interval = None if schedule is None else interval_of(schedule, since)
    return interval is not None and now - since > interval + grace


def _schedule(row: UntriggeredSchedule | BlockingRun) -> schedules.Recurrence | None:
    return schedules.recurrence_of(row.cron, row.timezone, dst_gap=row.dst_gap, dst_fold=row.dst_fold,
                                   every_sec=row.every_sec, phase_sec=row.phase_sec, start_at=row.start_at,
                                   end_at=row.end_at)


@dataclass(frozen=True, slots=True)
class Stall:
    job_id: uuid.UUID
    owner: str
    cause: str  # overdue | no_trigger | held
    since: datetime
    detail: str
    fire_at: datetime | None = None
    run_id: uuid.UUID | None = None

    @property
    def incident(self) -> str:
        """Names this incident: the same stall seen again is notified once."""
        moment = self.fire_at or self.since
        return f"{self.job_id}:schedule_stalled:{self.cause}:{self.run_id or ''}:{moment.isoformat()}"


class HealthCheck:
    def __init__(self, pool: Pool, grace: timedelta = GRACE, jobs_per_sweep: int = JOBS_PER_SWEEP) -> None:
        self._store = HealthStore(pool)
        self.grace = grace
        self.jobs_per_sweep = jobs_per_sweep
        self._swept_to = _BEFORE_ALL_IDS  # where the sweep for schedules without a trigger goes on

    async def sweep(self, now: datetime) -> int:
        """Queue notifications for what is unhealthy now; returns how many were queued."""
        overdue = await self._store.overdue_triggers(1.0, OVERDUE_PER_PARTITION)
        queued = await self._missed_starts(now, overdue)
        queued += await self._stalled_schedules(now, overdue)
        if queued:
            log.warning("schedule health: %d notifications queued", queued)
        return queued

    async def _missed_starts(self, now: datetime, overdue: list[OverdueTrigger]) -> int:
        late = await self._store.late_unstarted_runs(UNSTARTED_LOOKED_AT)
        queued = 0
        if late:
            queued += await self._store.notify_runs(
                "start_missed", [r.run_id for r in late], [r.scheduled_at for r in late],
                [f"not started {int((now - r.scheduled_at).total_seconds())}s after its scheduled time, past its "
                 f"start deadline of {r.start_deadline_sec}s: are workers running?" for r in late])
        # Slots never enqueued: their trigger is overdue past the start deadline. Keyed like the run
        # the slot will make, so a late fire of it later is not notified a second time.
        never = []
        for t in overdue:
            slot = t.fire_at - jitter_offset(t.job_id, t.jitter_sec) if t.recurring else scheduled_at_of(t.trigger_id)
            if now - t.fire_at > timedelta(seconds=t.start_deadline_sec):
                run_id = run_id_for(t.job_id, slot) if t.recurring else t.trigger_id
                never.append((t, slot, run_id))
        if never:
            queued += await self._store.notify_jobs(
                "start_missed", [t.job_id for t, _, _ in never],
                [f"{run_id}:start_missed" for _, _, run_id in never],
                [f"not fired {int((now - t.fire_at).total_seconds())}s after it was due, past its start deadline "
                 f"of {t.start_deadline_sec}s: " + _why_not_fired(t) for t, _, _ in never],
                [slot for _, slot, _ in never], [run_id for _, _, run_id in never])
        return queued

    async def _stalled_schedules(self, now: datetime, overdue: list[OverdueTrigger]) -> int:
        stalls: dict[uuid.UUID, Stall] = {}
        for t in overdue:
            if t.recurring and now - t.fire_at > self.grace:
                stalls[t.job_id] = Stall(
                    t.job_id, t.owner, "overdue", t.fire_at,
                    f"its fire due at {t.fire_at.isoformat()} has not happened: {_why_not_fired(t)}", t.fire_at)
        for job in await self._without_trigger():
            if stalled(job.last_fire, _schedule(job), now, self.grace):
                stalls[job.job_id] = Stall(
                    job.job_id, job.owner, "no_trigger", job.last_fire,
                    f"no fire since {job.last_fire.isoformat()}: the job's trigger is missing")
        held = []
        for r in await self._store.blocking_runs(self.grace.total_seconds()):
            if stalled(r.since, _schedule(r), now, self.grace):
                held.append(r)
                stalls.setdefault(r.job_id, Stall(
                    r.job_id, r.owner, "held", r.since,
                    f"no run has started since {r.since.isoformat()}: run {r.run_id} is still holding the "
                    "schedule", run_id=r.run_id))
        await self._store.record_stalls([
            StallRecord(job_id=s.job_id, owner=s.owner, cause=s.cause, since=s.since, detail=s.detail,
                        fire_at=s.fire_at, run_id=s.run_id)
            for s in stalls.values()])
        queued = 0
        if held:  # notified per run, as before: the payload names the run
            queued += await self._store.notify_runs(
                "schedule_stalled", [r.run_id for r in held], [r.scheduled_at for r in held],
                [f"no run has started since {r.since.isoformat()}: this run is still holding the schedule"
                 for r in held])
        others = [s for s in stalls.values() if s.cause != "held"]
        if others:
            queued += await self._store.notify_jobs(
                "schedule_stalled", [s.job_id for s in others], [s.incident for s in others],
                [s.detail for s in others], [s.fire_at for s in others], [None for _ in others])
        return queued

    async def _without_trigger(self) -> list[UntriggeredSchedule]:
        """One bounded step of the sweep over all jobs; starts over after the last."""
        start = self._swept_to
        end = await self._store.job_sweep_end(start, self.jobs_per_sweep)
        if end is None:  # past the last job: the next sweep starts over
            self._swept_to = _BEFORE_ALL_IDS
            return []
        self._swept_to = end
        return await self._store.schedules_without_trigger(start, end)


def _why_not_fired(trigger: OverdueTrigger) -> str:
    if not trigger.leased:
        return f"partition {trigger.partition_id} has no live scheduler node"
    return f"partition {trigger.partition_id} is owned but its node is behind (overloaded?)"
