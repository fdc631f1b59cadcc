"""Turning due triggers into fires: the run each one makes and where its schedule goes next."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from chimes import cron
from chimes.ids import run_id_for, scheduled_at_of
from chimes.store.scheduling import RETRY, DueTrigger, Fire


def plan_fire(trigger: DueTrigger) -> Fire:
    """Pure: no clock, no I/O. The next fire is computed from the scheduled time, never from now,
    so a recurring job does not drift however late this fire is."""
    if trigger.kind == RETRY:
        return Fire(trigger, trigger.trigger_id, scheduled_at_of(trigger.trigger_id), None)
    next_fire_at: datetime | None = None
    if trigger.cron is not None and trigger.timezone is not None:
        next_fire_at = cron.next_fire(cron.CronSchedule(trigger.cron, trigger.timezone), trigger.fire_at)
    return Fire(trigger, run_id_for(trigger.job_id, trigger.fire_at), trigger.fire_at, next_fire_at)


def plan_fires(triggers: Iterable[DueTrigger]) -> list[Fire]:
    return [plan_fire(t) for t in triggers]


def follow_up(fire: Fire) -> DueTrigger | None:
    """The trigger this fire leaves behind, so the node can hold it without waiting for a scan."""
    if fire.next_fire_at is None:
        return None
    t = fire.trigger
    return DueTrigger(t.partition_id, fire.next_fire_at, t.trigger_id, t.job_id, t.job_version, t.kind,
                      t.cron, t.timezone)
