"""Pure planning of fires: DST policy per job, jitter, and catch-up of missed slots."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from chimes import cron
from chimes.enums import TriggerKind
from chimes.ids import run_id_for
from chimes.scheduler.firing import plan_fire
from chimes.schedules import Recurrence
from chimes.slots import MAX_RECORDED, catch_up, jitter_offset
from chimes.store.scheduling import DueTrigger

JOB = uuid.UUID("0193a0b0-0000-7000-8000-000000000001")
NY = "America/New_York"


def z(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def trigger(fire_at: datetime, expr: str = "30 2 * * *", zone: str = NY, **extra: object) -> DueTrigger:
    return DueTrigger(0, fire_at, JOB, JOB, 1, TriggerKind.SCHEDULE, expr, zone, **extra)  # type: ignore[arg-type]


@pytest.mark.parametrize(("gap", "expected"), [
    (None, z(2027, 3, 14, 7, 0)),     # shift: the first instant after the gap, 03:00 EDT
    ("shift", z(2027, 3, 14, 7, 0)),
    ("skip", z(2027, 3, 15, 6, 30)),  # no run on the spring-forward day
])
def test_dst_gap_policy_decides_the_next_fire(gap: str | None, expected: datetime) -> None:
    fire = plan_fire(trigger(z(2027, 3, 13, 7, 30), dst_gap=gap))
    assert fire.next_fire_at == expected


@pytest.mark.parametrize(("fold", "expected"), [
    ("first", [z(2026, 11, 1, 5, 30), z(2026, 11, 2, 6, 30)]),
    ("last", [z(2026, 11, 1, 6, 30), z(2026, 11, 2, 6, 30)]),
    ("both", [z(2026, 11, 1, 5, 30), z(2026, 11, 1, 6, 30), z(2026, 11, 2, 6, 30)]),
])
def test_dst_fold_policy_decides_the_fires_of_the_fall_back_day(fold: str, expected: list[datetime]) -> None:
    fires, fire_at = [], z(2026, 10, 31, 5, 30)
    for _ in range(len(expected)):
        planned = plan_fire(trigger(fire_at, "30 1 * * *", dst_fold=fold))
        assert planned.next_fire_at is not None
        fire_at = planned.next_fire_at
        fires.append(fire_at)
    assert fires == expected


def test_jitter_moves_the_fire_but_not_the_slot() -> None:
    offset = jitter_offset(JOB, 30)
    assert timedelta(0) <= offset < timedelta(seconds=30)
    assert offset == jitter_offset(JOB, 30)  # stable
    assert jitter_offset(JOB, 0) == timedelta(0)
    fire = plan_fire(trigger(z(2026, 12, 1, 10, 0) + offset, "0 * * * *", "UTC", jitter_sec=30))
    assert fire.scheduled_at == z(2026, 12, 1, 10, 0) and fire.run_id == run_id_for(JOB, z(2026, 12, 1, 10, 0))
    assert fire.next_fire_at == z(2026, 12, 1, 11, 0) + offset


def test_offsets_spread_over_the_window() -> None:
    offsets = {jitter_offset(uuid.uuid4(), 60) // timedelta(seconds=10) for _ in range(600)}
    assert offsets == {0, 1, 2, 3, 4, 5}


def test_a_late_fire_within_the_threshold_is_just_late() -> None:
    fire = plan_fire(trigger(z(2026, 12, 1, 10, 0), "* * * * *", "UTC"), now=z(2026, 12, 1, 10, 0, 30))
    assert [(s.scheduled_at, s.trigger, s.outcome) for s in fire.slots] == [(z(2026, 12, 1, 10, 0), "schedule", "run")]
    assert fire.next_fire_at == z(2026, 12, 1, 10, 1)


EVERY_MINUTE = Recurrence(cron.CronSchedule("* * * * *", "UTC"))


@pytest.mark.parametrize(("policy", "outcomes"), [
    ({"policy": "one"}, ["skip"] * 4 + ["run"]),
    ({"policy": "all", "maxRuns": 2}, ["skip"] * 3 + ["run"] * 2),
    ({"policy": "all", "maxRuns": 10}, ["run"] * 5),
    ({"policy": "none"}, ["skip"] * 5),
])
def test_catch_up_policies(policy: dict, outcomes: list[str]) -> None:
    slots, following = catch_up(JOB, EVERY_MINUTE, z(2026, 12, 1, 10, 0), z(2026, 12, 1, 10, 4, 30), policy,
                                "missed")
    assert [s.scheduled_at.minute for s in slots] == [0, 1, 2, 3, 4]
    assert [s.outcome for s in slots] == outcomes
    assert all(s.trigger == ("catchup" if s.outcome == "run" else "schedule") for s in slots)
    assert all(s.reason and s.reason.startswith("missed") for s in slots)
    assert following == z(2026, 12, 1, 10, 5)


def test_catch_up_window_skips_the_old_ones() -> None:
    slots, _ = catch_up(JOB, EVERY_MINUTE, z(2026, 12, 1, 10, 0), z(2026, 12, 1, 10, 9, 30),
                        {"policy": "all", "maxRuns": 100, "windowSec": 300}, "paused")
    old = [s for s in slots if "older than the catch-up window" in (s.reason or "")]
    assert [s.scheduled_at.minute for s in old] == [0, 1, 2, 3, 4]
    assert all(s.outcome == "skip" and s.reason.startswith("paused") for s in old)
    assert [s.outcome for s in slots[5:]] == ["run"] * 5


def test_a_long_outage_records_a_bounded_number_of_slots() -> None:
    every_second = Recurrence(cron.CronSchedule("* * * * * *", "UTC"))
    start = z(2026, 12, 1, 0, 0)
    slots, following = catch_up(JOB, every_second, start, start + timedelta(hours=1), {"policy": "one"}, "missed")
    assert len(slots) == MAX_RECORDED
    assert slots[-1].scheduled_at == start + timedelta(hours=1) and slots[-1].outcome == "run"
    assert "not recorded one by one" in (slots[0].reason or "")
    assert following == start + timedelta(hours=1, seconds=1)


def test_one_off_missed_runs_once_late_or_not_at_all() -> None:
    at = z(2026, 12, 1, 9, 0)
    [ran], following = catch_up(JOB, None, at, at + timedelta(hours=1), {"policy": "one"}, "missed")
    assert (ran.outcome, ran.trigger, following) == ("run", "catchup", None)
    [skipped], _ = catch_up(JOB, None, at, at + timedelta(hours=1), {"policy": "none"}, "missed")
    assert skipped.outcome == "skip"
