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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from chimes import schedules
from chimes.enums import RunTrigger
from chimes.ids import run_id_for
from chimes.settings import CATCH_UP_WINDOW_SEC

MAX_RECORDED = 1000  # slots recorded per catch-up; older missed slots are counted in a note
MAX_WALK = 100_000  # slots walked for one fire, so that planning it stays bounded

# Why a slot was not fired on time: a cause given to each one, as its record says.
Cause = Callable[[datetime], str]
# What the record of an instant an exclusion calendar excludes says ("excluded by calendar NAME");
# None: not excluded.
Exclusion = Callable[[datetime], str | None]


@dataclass(frozen=True, slots=True)
class Slot:
    run_id: uuid.UUID
    scheduled_at: datetime
    trigger: RunTrigger  # SCHEDULE or CATCHUP
    outcome: str  # "run" | "skip"
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Walk:
    """The slots of a schedule from a first one up to an instant, walked within MAX_WALK."""

    slots: list[datetime]  # the newest MAX_RECORDED of them, oldest first
    unrecorded: int  # older slots walked but not kept
    following: datetime | None  # the slot after the walk: after ``until``, or at or before it when cut short
    complete: bool  # whether the walk reached ``until`` (or the schedule's end)

    @property
    def accounted(self) -> int:
        """Every slot the walk went through, kept or not: what a run cap counts."""
        return len(self.slots) + self.unrecorded


def jitter_offset(job_id: uuid.UUID, jitter_sec: int) -> timedelta:
    """A stable per-job delay in [0, jitter_sec): spreads jobs that share a schedule."""
    if jitter_sec <= 0:
        return timedelta(0)
    digest = hashlib.blake2b(job_id.bytes, digest_size=8).digest()
    return timedelta(milliseconds=int.from_bytes(digest, "big") % (jitter_sec * 1000))


def on_time(job_id: uuid.UUID, nominal: datetime) -> Slot:
    return Slot(run_id_for(job_id, nominal), nominal, RunTrigger.SCHEDULE, "run")


def walk(schedule: schedules.Recurrence | None, first: datetime, until: datetime, policy: Mapping[str, Any],
         cap: int | None = None) -> Walk:
    """The slots from ``first`` (a slot, included) up to ``until``, at most ``cap`` of them (a run cap:
    the schedule ends at its ``cap``-th slot). None for ``schedule``: a one-off, whose one slot is ``first``.

    A walk stops after MAX_WALK slots. Without a cap it then jumps to the catch-up window, as the slots
    before it are skipped anyway; with one it stops there (``complete`` False, ``following`` the next
    slot, already due), so that the cap counts every slot and the next fire goes on from there.
    """
    if schedule is None:
        return Walk([first] if first <= until else [], 0, None, True)
    kept: deque[datetime] = deque(maxlen=MAX_RECORDED)
    walked = 0
    slot: datetime | None = first
    while slot is not None and slot <= until:
        if cap is not None and walked >= cap:
            return _walked(kept, walked, None, True)
        kept.append(slot)
        walked += 1
        following = schedules.next_fire(schedule, slot)
        if walked % MAX_WALK == 0 and following is not None and following <= until:
            if cap is not None:
                return _walked(kept, walked, following, False)
            window_start = until - timedelta(seconds=int(policy.get("windowSec", CATCH_UP_WINDOW_SEC)))
            jump = schedules.next_fire(schedule, max(slot, window_start - timedelta(seconds=1)))
            following = jump if jump is not None and jump > slot else following
        slot = following
    if cap is not None and walked >= cap:
        return _walked(kept, walked, None, True)
    return _walked(kept, walked, slot, True)


def _walked(kept: deque[datetime], walked: int, following: datetime | None, complete: bool) -> Walk:
    return Walk(list(kept), walked - len(kept), following, complete)


def catch_up(
    job_id: uuid.UUID,
    missed: list[datetime],
    now: datetime,
    policy: Mapping[str, Any],
    cause: Cause,
    *,
    unrecorded: int = 0,
    excluded: Exclusion | None = None,
    final: bool = True,
) -> list[Slot]:
    """Account for every missed slot (oldest first) by the job's catch-up policy; each record says why
    (``cause`` of its instant: "missed", "paused"). ``unrecorded``: older missed slots left out, counted
    in a note on the oldest record. A slot ``excluded`` by a calendar never runs and is never the one a
    policy runs for the others. ``final`` False: newer missed slots follow in a later fire, so none of
    these runs."""
    window_start = now - timedelta(seconds=int(policy.get("windowSec", CATCH_UP_WINDOW_SEC)))
    decided: dict[datetime, Slot] = {}
    eligible: list[datetime] = []
    for s in missed:
        excluding = excluded(s) if excluded is not None else None
        if s < window_start:
            decided[s] = _skip(job_id, s, f"{cause(s)}; older than the catch-up window")
        elif excluding is not None:
            decided[s] = _skip(job_id, s, f"{excluding} ({cause(s)})")
        else:
            eligible.append(s)
    decided.update((slot.scheduled_at, slot) for slot in _apply_policy(job_id, eligible, policy, cause, final))
    slots = [decided[s] for s in missed]
    if unrecorded and slots:
        first = slots[0]
        note = f"{first.reason}; {unrecorded} earlier {cause(first.scheduled_at)} fires are not recorded one by one"
        slots[0] = replace(first, reason=note)
    return slots


def _skip(job_id: uuid.UUID, slot: datetime, reason: str) -> Slot:
    return Slot(run_id_for(job_id, slot), slot, RunTrigger.SCHEDULE, "skip", reason)


def _apply_policy(job_id: uuid.UUID, recent: list[datetime], policy: Mapping[str, Any], cause: Cause,
                  final: bool) -> list[Slot]:
    if not recent:
        return []
    name = policy.get("policy", "one")
    if name == "none":
        return [_skip(job_id, s, f"{cause(s)} (catch-up policy: none)") for s in recent]
    if not final:
        return [_skip(job_id, s, f"{cause(s)}; caught up by a later run") for s in recent]
    keep = 1 if name == "one" else int(policy.get("maxRuns", 10))
    ran, skipped = recent[-keep:], recent[:-keep]
    newest = ran[-1].isoformat().replace("+00:00", "Z")
    late = "one catch-up run for {count} missed fires" if name == "one" and skipped else "run late by catch-up"

    def skip_reason(s: datetime) -> str:
        return (f"{cause(s)}; caught up by the run of {newest}" if name == "one"
                else f"{cause(s)}; beyond catchUp.maxRuns ({keep})")

    return ([_skip(job_id, s, skip_reason(s)) for s in skipped]
            + [Slot(run_id_for(job_id, s), s, RunTrigger.CATCHUP, "run",
                    f"{cause(s)}; {late.format(count=len(recent))}") for s in ran])
