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
    return DueTrigger(17, fire_at, TRIGGER, JOB, 3, TriggerKind.SCHEDULE, cron, timezone)


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
    trigger = DueTrigger(17, retry_at, run_id, JOB, 3, TriggerKind.RETRY, "*/5 * * * *", "UTC")
    fire = plan_fire(trigger)
    assert fire.run_id == run_id
    assert fire.scheduled_at == scheduled
    assert fire.next_fire_at is None
    assert follow_up(fire) is None


def test_follow_up_keeps_key_parts() -> None:
    trigger = schedule_trigger(z(2026, 1, 1, 10), "*/5 * * * *")
    nxt = follow_up(plan_fire(trigger))
    assert nxt == DueTrigger(17, z(2026, 1, 1, 10, 5), TRIGGER, JOB, 3, TriggerKind.SCHEDULE, "*/5 * * * *", "UTC")
    assert nxt.key == (17, z(2026, 1, 1, 10, 5), TRIGGER)


def test_plan_fires_keeps_order() -> None:
    triggers = [schedule_trigger(z(2026, 1, 1, 10, m), "* * * * *") for m in (3, 1, 2)]
    assert [f.scheduled_at for f in plan_fires(triggers)] == [z(2026, 1, 1, 10, m) for m in (3, 1, 2)]


def _fired(deadline: int | None, jitter: int = 0) -> Fire:
    trigger = DueTrigger(17, z(2026, 1, 1, 10), TRIGGER, JOB, 3, TriggerKind.SCHEDULE, "0 * * * *", "UTC",
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
