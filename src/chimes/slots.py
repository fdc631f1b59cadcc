"""The slots a schedule implies, and what becomes of each when fires were missed.

A *slot* is one nominal fire time of a job. Normally a slot is fired on time and makes one run. When
the scheduler was down, or the job was paused, a trigger comes due long after its slot; then every
slot between it and now is accounted for by the job's catch-up policy, and each one leaves a run
record saying what happened to it (ran late, or skipped, and why). Pure functions: no clock, no I/O.
"""

from __future__ import annotations

import hashlib
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from chimes import schedules
from chimes.enums import RunTrigger
from chimes.ids import run_id_for
from chimes.settings import CATCH_UP_WINDOW_SEC

MAX_RECORDED = 1000  # slots recorded per catch-up; older missed slots are counted in a note
MAX_WALK = 100_000  # slots walked before jumping to the catch-up window


@dataclass(frozen=True, slots=True)
class Slot:
    run_id: uuid.UUID
    scheduled_at: datetime
    trigger: RunTrigger  # SCHEDULE or CATCHUP
    outcome: str  # "run" | "skip"
    reason: str | None = None


def jitter_offset(job_id: uuid.UUID, jitter_sec: int) -> timedelta:
    """A stable per-job delay in [0, jitter_sec): spreads jobs that share a schedule."""
    if jitter_sec <= 0:
        return timedelta(0)
    digest = hashlib.blake2b(job_id.bytes, digest_size=8).digest()
    return timedelta(milliseconds=int.from_bytes(digest, "big") % (jitter_sec * 1000))


def on_time(job_id: uuid.UUID, nominal: datetime) -> Slot:
    return Slot(run_id_for(job_id, nominal), nominal, RunTrigger.SCHEDULE, "run")


def catch_up(
    job_id: uuid.UUID,
    schedule: schedules.Recurrence | None,
    first: datetime,
    now: datetime,
    policy: Mapping[str, Any],
    cause: str,
) -> tuple[list[Slot], datetime | None]:
    """Account for every slot from ``first`` up to ``now``; returns the slots (oldest first) and the
    next slot after ``now`` (None for a one-off job or a schedule that ends).

    ``cause`` names why they were missed ("missed" or "paused"), for the records.
    """
    missed, unrecorded, following = _missed_slots(schedule, first, now, policy)
    window_start = now - timedelta(seconds=int(policy.get("windowSec", CATCH_UP_WINDOW_SEC)))
    recent = [s for s in missed if s >= window_start]
    old = [s for s in missed if s < window_start]
    slots = [Slot(run_id_for(job_id, s), s, RunTrigger.SCHEDULE, "skip", f"{cause}; older than the catch-up window")
             for s in old]
    slots += _apply_policy(job_id, recent, policy, cause)
    if unrecorded and slots:
        first_slot = slots[0]
        note = f"{first_slot.reason}; {unrecorded} earlier {cause} fires are not recorded one by one"
        slots[0] = Slot(first_slot.run_id, first_slot.scheduled_at, first_slot.trigger, first_slot.outcome, note)
    return slots, following


def _missed_slots(
    schedule: schedules.Recurrence | None, first: datetime, now: datetime, policy: Mapping[str, Any]
) -> tuple[list[datetime], int, datetime | None]:
    """The newest MAX_RECORDED slots in [first, now], how many older ones were left out, and the next slot."""
    if schedule is None:
        return [first], 0, None
    kept: deque[datetime] = deque(maxlen=MAX_RECORDED)
    walked = 0
    slot: datetime | None = first
    while slot is not None and slot <= now:
        kept.append(slot)
        walked += 1
        if walked == MAX_WALK:  # a very long outage of a very frequent job: jump to the window
            window_start = now - timedelta(seconds=int(policy.get("windowSec", CATCH_UP_WINDOW_SEC)))
            jump = schedules.next_fire(schedule, max(slot, window_start - timedelta(seconds=1)))
            slot = jump if jump is not None and jump > slot else schedules.next_fire(schedule, slot)
            continue
        slot = schedules.next_fire(schedule, slot)
    return list(kept), max(0, walked - len(kept)), slot


def _apply_policy(job_id: uuid.UUID, recent: list[datetime], policy: Mapping[str, Any], cause: str) -> list[Slot]:
    if not recent:
        return []
    name = policy.get("policy", "one")
    if name == "none":
        return [Slot(run_id_for(job_id, s), s, RunTrigger.SCHEDULE, "skip", f"{cause} (catch-up policy: none)")
                for s in recent]
    keep = 1 if name == "one" else int(policy.get("maxRuns", 10))
    ran, skipped = recent[-keep:], recent[:-keep]
    newest = ran[-1].isoformat().replace("+00:00", "Z")
    late = f"{cause}; run late by catch-up"
    if name == "one" and skipped:
        late = f"{cause}; one catch-up run for {len(recent)} missed fires"
    skip_reason = (f"{cause}; caught up by the run of {newest}" if name == "one"
                   else f"{cause}; beyond catchUp.maxRuns ({keep})")
    return ([Slot(run_id_for(job_id, s), s, RunTrigger.SCHEDULE, "skip", skip_reason) for s in skipped]
            + [Slot(run_id_for(job_id, s), s, RunTrigger.CATCHUP, "run", late) for s in ran])
