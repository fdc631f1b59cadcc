"""Turning due triggers into fires: the runs each one makes and where its schedule goes next."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta

from chimes import schedules
from chimes.calendars import Calendar, first_excluding, named
from chimes.enums import TriggerKind
from chimes.ids import scheduled_at_of
from chimes.settings import MISSED_AFTER_SEC
from chimes.slots import Slot, catch_up, jitter_offset, on_time
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
        return Fire(trigger, trigger.trigger_id, scheduled_at_of(trigger.trigger_id), None)
    schedule = trigger.recurrence
    offset = jitter_offset(trigger.job_id, trigger.jitter_sec)
    nominal = trigger.fire_at - offset
    paused = _while_paused(trigger, nominal)
    on_time_fire = now is None or (not paused and now - trigger.fire_at <= missed_after)
    remaining = trigger.remaining_runs
    if schedule is not None and remaining is not None:
        until = now if now is not None and not on_time_fire else nominal
        schedule = schedules.capped(schedule, nominal, max(remaining, 1), until)
    if now is None or on_time_fire:
        slots = [on_time(trigger.job_id, nominal)]
        following = schedules.next_fire(schedule, nominal) if schedule is not None else None
    else:
        slots, following = catch_up(trigger.job_id, schedule, nominal, now, trigger.catch_up or {},
                                    "paused" if paused else "missed")
    excluding = _excluding(trigger, calendars)
    if excluding:
        slots = [_excluded(slot, excluding) for slot in slots]
    last = slots[-1]
    return Fire(trigger, last.run_id, last.scheduled_at, None if following is None else following + offset,
                tuple(slots))


def _excluding(trigger: DueTrigger, calendars: Mapping[tuple[str, str], Calendar] | None) -> list[Calendar]:
    """The calendars the trigger's job names. They fail closed: a name not among ``calendars``, or
    no calendars at all (none read yet), is a calendar that excludes every slot, saying why."""
    if not trigger.exclude_calendars:
        return []
    if calendars is None:
        return [Calendar.unusable(name, "not read yet") for name in trigger.exclude_calendars]
    return named(calendars, trigger.owner or "", trigger.exclude_calendars)


def _excluded(slot: Slot, excluding: list[Calendar]) -> Slot:
    """A slot that would run, recorded as skipped when a calendar excludes its time."""
    calendar = first_excluding(excluding, slot.scheduled_at) if slot.outcome == "run" else None
    if calendar is None:
        return slot
    reason = calendar.reason + (f" ({slot.reason})" if slot.reason else "")
    return Slot(slot.run_id, slot.scheduled_at, slot.trigger, "skip", reason)


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
    return DueTrigger(t.partition_id, fire.next_fire_at, t.trigger_id, t.job_id, t.job_version, t.kind,
                      t.cron, t.timezone, t.dst_gap, t.dst_fold, t.jitter_sec, t.catch_up, t.paused_at,
                      t.resumed_at, t.start_deadline_sec, t.every_sec, t.phase_sec, t.start_at, t.end_at, t.max_runs,
                      t.slots_fired + len(fire.slots) if t.max_runs is not None else 0, t.owner, t.exclude_calendars,
                      t.concurrency)


def fires_ahead(trigger: DueTrigger) -> bool:
    """Whether a trigger may be fired ahead of its time and committed at it (SchedulerStore.fire_ahead):
    a schedule's slot, of a job whose policy starts its runs (allow) or decides by the runs still
    active (skip, queue: checked again at the time). replace cancels the runs it replaces, which
    must not wait for the instant, and retry triggers are rare: they fire at their time."""
    return trigger.kind == TriggerKind.SCHEDULE and trigger.concurrency in FIRED_AHEAD_POLICIES


FIRED_AHEAD_POLICIES = frozenset({"allow", "skip", "queue"})
