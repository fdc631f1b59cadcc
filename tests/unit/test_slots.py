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
from chimes.slots import MAX_RECORDED, MAX_WALK, catch_up, jitter_offset, walk
from chimes.store.scheduling import DueTrigger

JOB = uuid.UUID("0193a0b0-0000-7000-8000-000000000001")
NY = "America/New_York"


def z(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def trigger(fire_at: datetime, expr: str = "30 2 * * *", zone: str = NY, **extra: object) -> DueTrigger:
    return DueTrigger(partition_id=0, fire_at=fire_at, trigger_id=JOB, job_id=JOB, job_version=1,
                      kind=TriggerKind.SCHEDULE, cron=expr, timezone=zone, **extra)  # type: ignore[arg-type]


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


def missed(*_: datetime) -> str:
    return "missed"


def caught_up(schedule: Recurrence | None, first: datetime, now: datetime, policy: dict,
              cause: str = "missed") -> tuple[list, datetime | None]:
    walked = walk(schedule, first, now, policy)
    return (catch_up(JOB, walked.slots, now, policy, lambda _: cause, unrecorded=walked.unrecorded),
            walked.following)


@pytest.mark.parametrize(("policy", "outcomes"), [
    ({"policy": "one"}, ["skip"] * 4 + ["run"]),
    ({"policy": "all", "maxRuns": 2}, ["skip"] * 3 + ["run"] * 2),
    ({"policy": "all", "maxRuns": 10}, ["run"] * 5),
    ({"policy": "none"}, ["skip"] * 5),
])
def test_catch_up_policies(policy: dict, outcomes: list[str]) -> None:
    slots, following = caught_up(EVERY_MINUTE, z(2026, 12, 1, 10, 0), z(2026, 12, 1, 10, 4, 30), policy)
    assert [s.scheduled_at.minute for s in slots] == [0, 1, 2, 3, 4]
    assert [s.outcome for s in slots] == outcomes
    assert all(s.trigger == ("catchup" if s.outcome == "run" else "schedule") for s in slots)
    assert all(s.reason and s.reason.startswith("missed") for s in slots)
    assert following == z(2026, 12, 1, 10, 5)


def test_catch_up_window_skips_the_old_ones() -> None:
    slots, _ = caught_up(EVERY_MINUTE, z(2026, 12, 1, 10, 0), z(2026, 12, 1, 10, 9, 30),
                         {"policy": "all", "maxRuns": 100, "windowSec": 300}, "paused")
    old = [s for s in slots if "older than the catch-up window" in (s.reason or "")]
    assert [s.scheduled_at.minute for s in old] == [0, 1, 2, 3, 4]
    assert all(s.outcome == "skip" and s.reason.startswith("paused") for s in old)
    assert [s.outcome for s in slots[5:]] == ["run"] * 5


def test_a_long_outage_records_a_bounded_number_of_slots() -> None:
    every_second = Recurrence(cron.CronSchedule("* * * * * *", "UTC"))
    start = z(2026, 12, 1, 0, 0)
    slots, following = caught_up(every_second, start, start + timedelta(hours=1), {"policy": "one"})
    assert len(slots) == MAX_RECORDED
    assert slots[-1].scheduled_at == start + timedelta(hours=1) and slots[-1].outcome == "run"
    assert "not recorded one by one" in (slots[0].reason or "")
    assert following == start + timedelta(hours=1, seconds=1)


def test_one_off_missed_runs_once_late_or_not_at_all() -> None:
    at = z(2026, 12, 1, 9, 0)
    [ran], following = caught_up(None, at, at + timedelta(hours=1), {"policy": "one"})
    assert (ran.outcome, ran.trigger, following) == ("run", "catchup", None)
    [skipped], _ = caught_up(None, at, at + timedelta(hours=1), {"policy": "none"})
    assert skipped.outcome == "skip"


def test_catch_up_runs_the_newest_slot_no_calendar_excludes() -> None:
    """With catchUp one, an excluded newest slot does not run, and the run the others name is one that
    exists: the newest slot that is not excluded."""
    slots = catch_up(JOB, [z(2026, 12, 1, 10, m) for m in range(5)], z(2026, 12, 1, 10, 4, 30), {"policy": "one"},
                     missed, excluded=lambda t: "excluded by calendar freeze" if t.minute >= 3 else None)
    assert [(s.scheduled_at.minute, s.outcome) for s in slots] == [
        (0, "skip"), (1, "skip"), (2, "run"), (3, "skip"), (4, "skip")]
    assert slots[0].reason == "missed; caught up by the run of 2026-12-01T10:02:00Z"
    assert slots[4].reason == "excluded by calendar freeze (missed)"
    everything = catch_up(JOB, [z(2026, 12, 1, 10, m) for m in range(3)], z(2026, 12, 1, 10, 4), {"policy": "one"},
                          missed, excluded=lambda _: "excluded by calendar freeze")
    assert [s.outcome for s in everything] == ["skip"] * 3
    assert all("caught up" not in (s.reason or "") for s in everything)


def test_a_capped_walk_counts_every_slot_in_bounded_parts() -> None:
    """A run cap larger than one fire's walk: the walk stops at MAX_WALK slots, says it is not
    complete, and the next fire goes on from the slot after it, so that every slot is counted."""
    every_second = Recurrence(cron.CronSchedule("* * * * * *", "UTC"))
    start = z(2026, 12, 1)
    now = start + timedelta(seconds=MAX_WALK + 500)
    first = walk(every_second, start, now, {}, cap=MAX_WALK + 10)
    assert (first.accounted, first.complete) == (MAX_WALK, False)
    assert first.following == start + timedelta(seconds=MAX_WALK)
    assert first.following is not None
    rest = walk(every_second, first.following, now, {}, cap=10)
    assert (rest.accounted, rest.complete, rest.following) == (10, True, None)
    uncapped = walk(every_second, start, now, {})
    assert uncapped.complete and uncapped.following == now + timedelta(seconds=1)
