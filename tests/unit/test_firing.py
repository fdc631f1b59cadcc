"""Tests for chimes.scheduler.firing: the run a due trigger makes and where its schedule goes next."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from chimes.enums import TriggerKind
from chimes.ids import run_id_for
from chimes.scheduler.firing import follow_up, plan_fire, plan_fires
from chimes.store.scheduling import DueTrigger, Fire, late_slots

JOB = uuid.UUID("0190a3b2-7c4d-7e5f-8a6b-9c0d1e2f3a4b")
TRIGGER = uuid.UUID("0190a3b2-0000-7000-8000-000000000001")


def z(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def schedule_trigger(fire_at: datetime, cron: str | None, timezone: str | None = "UTC") -> DueTrigger:
    return DueTrigger(partition_id=17, fire_at=fire_at, trigger_id=TRIGGER, job_id=JOB, job_version=3,
                      kind=TriggerKind.SCHEDULE, cron=cron, timezone=timezone)


@pytest.mark.parametrize(
    ("cron", "timezone", "fire_at", "next_fire_at"),
    [
        ("*/5 * * * *", "UTC", z(2026, 1, 1, 10), z(2026, 1, 1, 10, 5)),
        ("*/5 * * * *", "UTC", z(2026, 1, 1, 23, 55), z(2026, 1, 2, 0, 0)),
        ("*/2 * * * * *", "UTC", z(2026, 1, 1, 10), z(2026, 1, 1, 10, 0, 2)),
        ("0 9 * * *", "America/New_York", z(2026, 7, 1, 13), z(2026, 7, 2, 13)),  # 09:00 EDT
        ("0 0 29 2 *", "UTC", z(2024, 2, 29), z(2028, 2, 29)),
    ],
)
def test_schedule_trigger(cron: str, timezone: str, fire_at: datetime, next_fire_at: datetime) -> None:
    trigger = schedule_trigger(fire_at, cron, timezone)
    fire = plan_fire(trigger)
    assert fire.trigger is trigger
    assert fire.run_id == run_id_for(JOB, fire_at)
    assert fire.scheduled_at == fire_at
    assert fire.next_fire_at == next_fire_at


def test_next_fire_comes_from_the_scheduled_time_not_lateness() -> None:
    a = plan_fire(schedule_trigger(z(2026, 1, 1, 10), "*/5 * * * *"))
    b = plan_fire(schedule_trigger(z(2026, 1, 1, 10, 5), "*/5 * * * *"))
    assert a.next_fire_at == b.scheduled_at
    assert a.run_id != b.run_id


@pytest.mark.parametrize(("cron", "timezone"), [(None, None), (None, "UTC")])
def test_one_off_has_no_next(cron: str | None, timezone: str | None) -> None:
    fire_at = z(2026, 12, 1, 9)
    fire = plan_fire(schedule_trigger(fire_at, cron, timezone))
    assert fire.run_id == run_id_for(JOB, fire_at)
    assert fire.scheduled_at == fire_at
    assert fire.next_fire_at is None
    assert follow_up(fire) is None


def test_retry_trigger_reuses_the_run_id() -> None:
    scheduled = datetime(2026, 3, 1, 6, 0, 0, 123000, tzinfo=UTC)
    run_id = run_id_for(JOB, scheduled)
    retry_at = z(2026, 3, 1, 6, 0, 30)
    trigger = DueTrigger(partition_id=17, fire_at=retry_at, trigger_id=run_id, job_id=JOB, job_version=3,
                         kind=TriggerKind.RETRY, cron="*/5 * * * *", timezone="UTC")
    fire = plan_fire(trigger)
    assert fire.run_id == run_id
    assert fire.scheduled_at == scheduled
    assert fire.next_fire_at is None
    assert follow_up(fire) is None


def test_follow_up_keeps_key_parts() -> None:
    trigger = schedule_trigger(z(2026, 1, 1, 10), "*/5 * * * *")
    nxt = follow_up(plan_fire(trigger))
    assert nxt == DueTrigger(partition_id=17, fire_at=z(2026, 1, 1, 10, 5), trigger_id=TRIGGER, job_id=JOB,
                             job_version=3, kind=TriggerKind.SCHEDULE, cron="*/5 * * * *", timezone="UTC")
    assert nxt.key == (17, z(2026, 1, 1, 10, 5), TRIGGER)


def test_plan_fires_keeps_order() -> None:
    triggers = [schedule_trigger(z(2026, 1, 1, 10, m), "* * * * *") for m in (3, 1, 2)]
    assert [f.scheduled_at for f in plan_fires(triggers)] == [z(2026, 1, 1, 10, m) for m in (3, 1, 2)]


def _fired(deadline: int | None, jitter: int = 0) -> Fire:
    trigger = DueTrigger(partition_id=17, fire_at=z(2026, 1, 1, 10), trigger_id=TRIGGER, job_id=JOB, job_version=3,
                         kind=TriggerKind.SCHEDULE, cron="0 * * * *", timezone="UTC",
                         jitter_sec=jitter, start_deadline_sec=deadline)
    return plan_fire(trigger, z(2026, 1, 1, 10))


@pytest.mark.parametrize(
    ("deadline", "jitter", "late_sec", "missed"),
    [
        (300, 0, 5, False),  # a burst seconds behind: no query for the late fires
        (300, 0, 300, False),
        (300, 0, 301, True),
        (5, 10, 14, False),  # the deadline counts from the scheduled time plus the job's jitter
        (5, 10, 16, True),
        (None, 0, 1, False),  # not read with the trigger: anything past the smallest deadline (1 s)
        (None, 0, 2, True),
    ],
)
def test_a_fire_is_checked_for_a_missed_start_only_past_its_jobs_deadline(
    deadline: int | None, jitter: int, late_sec: int, missed: bool
) -> None:
    fire = _fired(deadline, jitter)
    late = late_slots([fire], fire.scheduled_at + timedelta(seconds=late_sec))
    assert late == (list(fire.slots) if missed else [])


def test_a_trigger_kept_by_an_edit_fires_the_slots_it_carries_and_leaves_no_next() -> None:
    """An edit found the slots 10:00:00 and 10:00:01 of the definition before it due and not fired: the
    trigger kept for them fires both (late, once each) under the schedule it was kept with, whatever the
    job's schedule is now, and leaves the next fire to the new definition's own trigger."""
    kept = DueTrigger(partition_id=17, fire_at=z(2026, 1, 1, 10), trigger_id=TRIGGER, job_id=JOB, job_version=4,
                      kind=TriggerKind.SCHEDULE, cron="0 * * * *", timezone="UTC",
                      carried_until=z(2026, 1, 1, 10, 0, 1, 500000),
                      carried_slots=[z(2026, 1, 1, 10), z(2026, 1, 1, 10, 0, 1)])
    fire = plan_fire(kept, z(2026, 1, 1, 10, 0, 2))
    assert [(s.scheduled_at, s.outcome, s.trigger) for s in fire.slots] == [
        (z(2026, 1, 1, 10), "run", "schedule"), (z(2026, 1, 1, 10, 0, 1), "run", "schedule")]
    assert fire.next_fire_at is None and follow_up(fire) is None
    assert fire.accounted == 2


def test_a_trigger_kept_long_ago_is_caught_up_by_the_policy() -> None:
    kept = DueTrigger(partition_id=17, fire_at=z(2026, 1, 1, 10), trigger_id=TRIGGER, job_id=JOB, job_version=4,
                      kind=TriggerKind.SCHEDULE, cron="* * * * *", timezone="UTC",
                      catch_up={"policy": "one"}, carried_until=z(2026, 1, 1, 10, 2, 30),
                      carried_slots=[z(2026, 1, 1, 10, m) for m in range(3)], carried_unrecorded=7)
    fire = plan_fire(kept, z(2026, 1, 1, 12))
    assert [s.outcome for s in fire.slots] == ["skip", "skip", "run"]
    assert "7 earlier missed fires are not recorded one by one" in (fire.slots[0].reason or "")
    assert fire.accounted == 10


def test_a_trigger_kept_by_a_pause_fires_the_slots_due_before_it() -> None:
    """A pause that found the 10:00:00 slot due kept its trigger without a list: the slots of the job's
    schedule up to the pause fire, and none after it, though the job stays paused."""
    kept = DueTrigger(partition_id=17, fire_at=z(2026, 1, 1, 10), trigger_id=TRIGGER, job_id=JOB, job_version=5,
                      kind=TriggerKind.SCHEDULE, cron="* * * * * *", timezone="UTC",
                      paused=True, paused_at=z(2026, 1, 1, 10, 0, 2, 300000),
                      carried_until=z(2026, 1, 1, 10, 0, 2, 300000))
    fire = plan_fire(kept, z(2026, 1, 1, 10, 0, 5))
    assert [s.scheduled_at.second for s in fire.slots] == [0, 1, 2]
    assert all(s.outcome == "run" for s in fire.slots) and fire.next_fire_at is None


def test_a_run_cap_counts_the_slots_a_long_outage_left_unrecorded() -> None:
    """Two hours of an every-second job missed with 5,000 runs left: the fire records the newest 1,000 of
    the 5,000 slots it went through and counts all of them, so the cap ends the schedule there."""
    trigger = DueTrigger(partition_id=17, fire_at=z(2026, 1, 1, 10), trigger_id=TRIGGER, job_id=JOB, job_version=4,
                         kind=TriggerKind.SCHEDULE, cron="* * * * * *", timezone="UTC",
                         max_runs=5100, slots_fired=100)
    fire = plan_fire(trigger, z(2026, 1, 1, 12))
    assert len(fire.slots) == 1000 and fire.accounted == 5000
    assert fire.next_fire_at is None
    assert fire.slots[-1].scheduled_at == z(2026, 1, 1, 10) + timedelta(seconds=4999)
