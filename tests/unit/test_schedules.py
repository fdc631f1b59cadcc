"""Interval schedules, bounds on recurring schedules, and the previews built on them: pure tables of datetimes."""

from __future__ import annotations

import itertools
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from chimes import cron, previews, schedules
from chimes.enums import TriggerKind
from chimes.jobs import IntervalScheduleSpec, JobSpec
from chimes.scheduler.firing import follow_up, plan_fire
from chimes.schedules import IntervalSchedule, Recurrence
from chimes.slots import jitter_offset
from chimes.store.scheduling import DueTrigger

JOB = uuid.UUID("0193a0b0-0000-7000-8000-000000000002")
EVERY_90M_AT_15 = Recurrence(IntervalSchedule(5400, 900))


def z(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


@pytest.mark.parametrize(("text", "seconds"), [
    ("90m", 5400), ("1h30m", 5400), ("45s", 45), ("2d", 172800), ("1d2h3m4s", 93784), (" 5m ", 300),
])
def test_durations_read_largest_unit_first(text: str, seconds: int) -> None:
    assert schedules.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "90", "m", "30m1h", "1.5h", "-5m", "5 m", "1w"])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(schedules.ScheduleError, match="invalid duration"):
        schedules.parse_duration(text)


def test_format_duration_is_the_shortest_text() -> None:
    assert [schedules.format_duration(s) for s in (5400, 900, 86400, 61, 0)] == ["1h30m", "15m", "1d", "1m1s", "0s"]


@pytest.mark.parametrize(("after", "expected"), [
    (z(2026, 1, 1, 0, 0), z(2026, 1, 1, 0, 15)),
    (z(2026, 1, 1, 0, 15), z(2026, 1, 1, 1, 45)),  # strictly after
    (z(2026, 1, 1, 0, 14, 59, 999000), z(2026, 1, 1, 0, 15)),
    (z(2026, 1, 1, 1, 44, 59), z(2026, 1, 1, 1, 45)),
    (z(2026, 1, 1, 23, 0), z(2026, 1, 2, 0, 15)),  # 16 intervals a day: every day has the same fires
])
def test_intervals_fire_at_epoch_plus_phase(after: datetime, expected: datetime) -> None:
    assert schedules.next_fire(EVERY_90M_AT_15, after) == expected


def test_interval_fires_are_the_same_from_any_starting_point() -> None:
    walked = schedules.fire_times(EVERY_90M_AT_15, z(2026, 1, 1), z(2026, 1, 3), 100)
    from_elsewhere = schedules.fire_times(EVERY_90M_AT_15, z(2026, 1, 1, 7, 3, 11), z(2026, 1, 3), 100)
    assert from_elsewhere == [t for t in walked if t > z(2026, 1, 1, 7, 3, 11)]
    assert all((b - a) == timedelta(minutes=90) for a, b in itertools.pairwise(walked))


def test_intervals_count_elapsed_time_across_dst() -> None:
    """New York springs forward on 2026-03-08 07:00Z: an interval neither skips nor doubles a fire."""
    hourly = Recurrence(IntervalSchedule(3600))
    fires = schedules.fire_times(hourly, z(2026, 3, 8, 5), z(2026, 3, 8, 9), 10)
    assert fires == [z(2026, 3, 8, h) for h in (6, 7, 8, 9)]


@pytest.mark.parametrize(("every", "phase", "message"), [
    (0, 0, "interval must be between"), (400 * 86400, 0, "interval must be between"),
    (60, 60, "phase must be"), (60, -1, "phase must be"),
])
def test_bad_intervals_are_refused(every: int, phase: int, message: str) -> None:
    with pytest.raises(schedules.ScheduleError, match=message):
        IntervalSchedule(every, phase)


def test_bounds_hold_fires_between_start_and_end_inclusive() -> None:
    every_5m = Recurrence(cron.CronSchedule("*/5 * * * *", "UTC"), z(2026, 1, 1, 10, 2), z(2026, 1, 1, 10, 20))
    assert schedules.fire_times(every_5m, z(2026, 1, 1), z(2026, 1, 2), 100) == [
        z(2026, 1, 1, 10, m) for m in (5, 10, 15, 20)]
    assert schedules.next_fire(every_5m, z(2026, 1, 1, 10, 20)) is None
    on_the_start = Recurrence(IntervalSchedule(600), start_at=z(2026, 1, 1, 10, 10, 0, 500000))
    assert schedules.next_fire(on_the_start, z(2026, 1, 1)) == z(2026, 1, 1, 10, 20)


def test_spec_takes_durations_or_seconds_and_stores_seconds() -> None:
    given = IntervalScheduleSpec.model_validate({"every": "90m", "phase": "15m"})
    assert given == IntervalScheduleSpec.model_validate({"everySec": 5400, "phaseSec": 900})
    assert given.model_dump(by_alias=True, exclude_none=True) == {"everySec": 5400, "phaseSec": 900, "jitterSec": 0}


@pytest.mark.parametrize(("schedule", "message"), [
    ({"every": "0s"}, "greater than or equal to 1"),
    ({"everySec": 0}, "greater than or equal to 1"),
    ({"every": "90"}, "invalid duration"),
    ({"every": "90m", "everySec": 5400}, "either 'every' or 'everySec'"),
    ({"every": "1h", "phase": "1h"}, "must be less than everySec"),
    ({"every": "1h", "cron": "* * * * *"}, "exactly one of"),
    ({"cron": "* * * * *", "startAt": "2026-02-01T00:00:00Z", "endAt": "2026-01-01T00:00:00Z"},
     "must be after startAt"),
    ({"every": "1h", "endAt": "2026-01-01T00:00:00"}, "timezone"),
])
def test_bad_schedules_name_the_problem(schedule: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        JobSpec.model_validate({"name": "j", "schedule": schedule, "task": {"type": "http", "url": "http://x"}})


def test_an_interval_job_fires_with_jitter_and_its_next_slot_on_the_grid() -> None:
    offset = jitter_offset(JOB, 60)
    slot = z(2026, 1, 1, 1, 45)
    trigger = DueTrigger(partition_id=0, fire_at=slot + offset, trigger_id=JOB, job_id=JOB, job_version=1,
                         kind=TriggerKind.SCHEDULE, cron=None, timezone="UTC", jitter_sec=60,
                         every_sec=5400, phase_sec=900)
    fire = plan_fire(trigger, slot + offset)
    assert fire.scheduled_at == slot
    assert fire.next_fire_at == z(2026, 1, 1, 3, 15) + offset


def test_interval_catch_up_follows_the_policy() -> None:
    trigger = DueTrigger(partition_id=0, fire_at=z(2026, 1, 1, 0, 15), trigger_id=JOB, job_id=JOB, job_version=1,
                         kind=TriggerKind.SCHEDULE, cron=None, timezone="UTC",
                         catch_up={"policy": "all", "maxRuns": 2}, every_sec=5400, phase_sec=900)
    fire = plan_fire(trigger, z(2026, 1, 1, 5))
    assert [(s.scheduled_at, s.outcome) for s in fire.slots] == [
        (z(2026, 1, 1, 0, 15), "skip"), (z(2026, 1, 1, 1, 45), "skip"), (z(2026, 1, 1, 3, 15), "run"),
        (z(2026, 1, 1, 4, 45), "run")]
    assert fire.next_fire_at == z(2026, 1, 1, 6, 15)


def test_a_bounded_job_leaves_no_trigger_after_its_last_slot() -> None:
    trigger = DueTrigger(partition_id=0, fire_at=z(2026, 1, 1, 10), trigger_id=JOB, job_id=JOB, job_version=1,
                         kind=TriggerKind.SCHEDULE, cron="0 * * * *", timezone="UTC",
                         end_at=z(2026, 1, 1, 10, 30))
    assert plan_fire(trigger, z(2026, 1, 1, 10)).next_fire_at is None


def test_previews_apply_dst_policy_and_jitter_like_the_scheduler() -> None:
    definition = {"schedule": {"cron": "30 2 * * *", "timezone": "America/New_York", "dstGap": "skip",
                               "jitterSec": 600}}
    offset = jitter_offset(JOB, 600)
    first = z(2026, 3, 7, 7, 30) + offset
    # 2026-03-08 02:30 does not exist in New York and the job skips it.
    assert previews.upcoming(definition, JOB, first, 3) == [
        first, z(2026, 3, 9, 6, 30) + offset, z(2026, 3, 10, 6, 30) + offset]
    assert previews.upcoming(definition, JOB, None, 3) == []


def test_a_run_cap_ends_the_schedule_at_its_last_slot() -> None:
    trigger = DueTrigger(partition_id=0, fire_at=z(2026, 1, 1, 10), trigger_id=JOB, job_id=JOB, job_version=1,
                         kind=TriggerKind.SCHEDULE, cron="0 * * * *", timezone="UTC",
                         max_runs=3, slots_fired=1)
    second = plan_fire(trigger)
    assert second.next_fire_at == z(2026, 1, 1, 11)
    third = follow_up(second)
    assert third is not None and third.slots_fired == 2
    assert plan_fire(third).next_fire_at is None  # the third slot was the last


def test_a_run_cap_bounds_a_catch_up_to_the_slots_left() -> None:
    """Two slots left, seven missed: the two oldest are the job's last; nothing after is recorded."""
    trigger = DueTrigger(partition_id=0, fire_at=z(2026, 1, 1, 10), trigger_id=JOB, job_id=JOB, job_version=1,
                         kind=TriggerKind.SCHEDULE, cron="*/10 * * * *", timezone="UTC",
                         catch_up={"policy": "one"}, max_runs=5, slots_fired=3)
    fire = plan_fire(trigger, z(2026, 1, 1, 11, 1))
    assert [(s.scheduled_at, s.outcome) for s in fire.slots] == [
        (z(2026, 1, 1, 10), "skip"), (z(2026, 1, 1, 10, 10), "run")]
    assert fire.next_fire_at is None


def test_previews_stop_at_the_run_cap() -> None:
    definition = {"schedule": {"everySec": 60, "maxRuns": 5}}
    first = z(2026, 1, 1, 0, 1)
    assert previews.upcoming(definition, JOB, first, 10, slots_fired=2) == [z(2026, 1, 1, 0, m) for m in (1, 2, 3)]
    assert previews.upcoming(definition, JOB, None, 10, slots_fired=5) == []
