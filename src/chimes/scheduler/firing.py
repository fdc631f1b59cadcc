"""Turning due triggers into fires: the runs each one makes and where its schedule goes next."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import datetime, timedelta

from chimes import schedules
from chimes.calendars import Calendar, first_excluding, named
from chimes.enums import TriggerKind
from chimes.ids import scheduled_at_of
from chimes.settings import MISSED_AFTER_SEC
from chimes.slots import Cause, Exclusion, Slot, catch_up, jitter_offset, on_time, walk
from chimes.store.scheduling import DueTrigger, Fire

# A trigger this late was missed (the scheduler was down, or the job paused), not merely delayed
# by a takeover: its slots follow the job's catch-up policy instead of firing one by one.
MISSED_AFTER = timedelta(seconds=MISSED_AFTER_SEC)


def plan_fire(trigger: DueTrigger, now: datetime | None = None, missed_after: timedelta = MISSED_AFTER,
              calendars: Mapping[tuple[str, str], Calendar] | None = None) -> Fire:
    """Pure: ``now`` is passed in. The next fire is computed from the slot, never from the clock, so
    a recurring job does not drift however late this fire is. Without ``now`` the fire is on time.
    ``calendars``: the owners' exclusion calendars, by (owner, name)."""
    if trigger.kind == TriggerKind.RETRY:
        return Fire(trigger=trigger, run_id=trigger.trigger_id, scheduled_at=scheduled_at_of(trigger.trigger_id),
                    next_fire_at=None)
    excluded = _exclusion(trigger, calendars)
    if trigger.kept:
        return _plan_kept(trigger, now, missed_after, excluded)
    schedule = trigger.recurrence
    offset = jitter_offset(trigger.job_id, trigger.jitter_sec)
    nominal = trigger.fire_at - offset
    late = now is not None and (_while_paused(trigger, nominal) or now - trigger.fire_at > missed_after)
    remaining = trigger.remaining_runs
    if not late or schedule is None:
        slots = [on_time(trigger.job_id, nominal)]
        ended = remaining is not None and remaining <= 1
        following = schedules.next_fire(schedule, nominal) if schedule is not None and not ended else None
        accounted = 1
        if late:  # a one-off's slot missed: one slot, by the catch-up policy
            assert now is not None
            slots = catch_up(trigger.job_id, [nominal], now, trigger.catch_up or {}, _cause(trigger),
                             excluded=excluded)
        elif excluded is not None:
            slots = [_excluded(slot, excluded) for slot in slots]
    else:
        assert now is not None
        walked = walk(schedule, nominal, now, trigger.catch_up or {}, None if remaining is None else max(remaining, 1))
        slots = catch_up(trigger.job_id, walked.slots, now, trigger.catch_up or {}, _cause(trigger),
                         unrecorded=walked.unrecorded, excluded=excluded, final=walked.complete)
        following, accounted = walked.following, walked.accounted
    last = slots[-1]
    return Fire(trigger=trigger, run_id=last.run_id, scheduled_at=last.scheduled_at,
                next_fire_at=None if following is None else following + offset, slots=tuple(slots),
                accounted=accounted)


def walks(trigger: DueTrigger, now: datetime, missed_after: timedelta = MISSED_AFTER) -> bool:
    """Whether planning this trigger's fire walks its schedule (a missed trigger, or one kept by an
    edit): work that grows with how much was missed, which the node does off its event loop."""
    if trigger.kind != TriggerKind.SCHEDULE:
        return False
    nominal = trigger.fire_at - jitter_offset(trigger.job_id, trigger.jitter_sec)
    return trigger.kept or _while_paused(trigger, nominal) or now - trigger.fire_at > missed_after


def _plan_kept(trigger: DueTrigger, now: datetime | None, missed_after: timedelta,
               excluded: Exclusion | None) -> Fire:
    """A trigger an edit or a pause kept: the slots of the definition before it that were due and had
    not fired, each once (late) or, missed, by the catch-up policy. It leaves no next trigger: the
    definition after the edit has a trigger of its own."""
    assert trigger.carried_until is not None
    policy = trigger.catch_up or {}
    if trigger.carried_slots is not None:
        missed, unrecorded = list(trigger.carried_slots), trigger.carried_unrecorded
    else:  # kept by a pause: the definition is still the one whose slots they are
        nominal = trigger.fire_at - jitter_offset(trigger.job_id, trigger.jitter_sec)
        remaining = trigger.remaining_runs
        walked = walk(trigger.recurrence, nominal, trigger.carried_until, policy,
                      None if remaining is None else max(remaining, 1))
        missed, unrecorded = walked.slots, walked.unrecorded
    if not missed:
        return Fire(trigger=trigger, run_id=trigger.trigger_id, scheduled_at=trigger.fire_at, next_fire_at=None)
    if now is None or now - trigger.fire_at <= missed_after:
        slots = [on_time(trigger.job_id, slot) for slot in missed]
        if excluded is not None:
            slots = [_excluded(slot, excluded) for slot in slots]
    else:
        slots = catch_up(trigger.job_id, missed, now, policy, _cause(trigger), unrecorded=unrecorded,
                         excluded=excluded)
    last = slots[-1]
    return Fire(trigger=trigger, run_id=last.run_id, scheduled_at=last.scheduled_at, next_fire_at=None,
                slots=tuple(slots), accounted=len(missed) + unrecorded)


def _cause(trigger: DueTrigger) -> Cause:
    """Why a slot of this trigger's job did not fire on time: the job was paused then, or not."""
    paused, resumed = trigger.paused_at, trigger.resumed_at

    def cause(slot: datetime) -> str:
        return "paused" if paused is not None and resumed is not None and paused <= slot <= resumed else "missed"

    return cause


def _exclusion(trigger: DueTrigger, calendars: Mapping[tuple[str, str], Calendar] | None) -> Exclusion | None:
    """The reason a calendar the trigger's job names gives for skipping an instant; None: none does.
    They fail closed: a name not among ``calendars``, or no calendars at all (none read yet), is a
    calendar that excludes every instant, saying why."""
    if not trigger.exclude_calendars:
        return None
    if calendars is None:
        excluding = [Calendar.unusable(name, "not read yet") for name in trigger.exclude_calendars]
    else:
        excluding = named(calendars, trigger.owner or "", trigger.exclude_calendars)

    def excluded(instant: datetime) -> str | None:
        calendar = first_excluding(excluding, instant)
        return None if calendar is None else calendar.reason

    return excluded


def _excluded(slot: Slot, excluded: Exclusion) -> Slot:
    """A slot that would run, recorded as skipped when a calendar excludes its time."""
    excluding = excluded(slot.scheduled_at) if slot.outcome == "run" else None
    if excluding is None:
        return slot
    reason = excluding + (f" ({slot.reason})" if slot.reason else "")
    return replace(slot, outcome="skip", reason=reason)


def _while_paused(trigger: DueTrigger, nominal: datetime) -> bool:
    """A slot of the last pause: resuming put the trigger back there so the paused slots are
    accounted for by the catch-up policy."""
    paused, resumed = trigger.paused_at, trigger.resumed_at
    return paused is not None and resumed is not None and paused <= nominal <= resumed


def plan_fires(triggers: Iterable[DueTrigger], now: datetime | None = None,
               missed_after: timedelta = MISSED_AFTER) -> list[Fire]:
    return [plan_fire(t, now, missed_after) for t in triggers]


def follow_up(fire: Fire) -> DueTrigger | None:
    """The trigger this fire leaves behind, so the node can hold it without waiting for a scan."""
    if fire.next_fire_at is None:
        return None
    t = fire.trigger
    return replace(t, fire_at=fire.next_fire_at,
                   slots_fired=t.slots_fired + fire.accounted if t.max_runs is not None else 0)


def fires_ahead(trigger: DueTrigger) -> bool:
    """Whether a trigger may be fired ahead of its time and committed at it (SchedulerStore.fire_ahead):
    a schedule's slot, of a job whose policy starts its runs (allow) or decides by the runs still
    active (skip, queue: checked again at the time). replace cancels the runs it replaces, which
    must not wait for the instant, and retry triggers are rare: they fire at their time."""
    return trigger.kind == TriggerKind.SCHEDULE and trigger.concurrency in FIRED_AHEAD_POLICIES


FIRED_AHEAD_POLICIES = frozenset({"allow", "skip", "queue"})
