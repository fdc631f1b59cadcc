"""Tests for chimes.cron. Every expected instant is worked out by hand and written as literal UTC.

Offsets used: America/New_York EST -5 / EDT -4 (2026: spring forward 2026-03-08 07:00Z,
fall back 2026-11-01 06:00Z); Europe/Berlin CET +1 / CEST +2 (2026: 2026-03-29 01:00Z and
2026-10-25 01:00Z); Asia/Kolkata +05:30 all year.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest

from chimes.cron import (
    CronError,
    CronSchedule,
    TimezoneError,
    fire_times,
    next_fire,
    parse_timezone,
    validate_cron,
)

NY = "America/New_York"
BER = "Europe/Berlin"
IST = "Asia/Kolkata"


def z(*args: int) -> datetime:
    """A UTC instant: z(2026, 3, 8, 7) is 2026-03-08T07:00:00Z."""
    return datetime(*args, tzinfo=UTC)


# One whole local calendar day, as the (exclusive start, inclusive end) UTC window.
NY_SPRING_DAY = (z(2026, 3, 8, 4, 59, 59), z(2026, 3, 9, 3, 59, 59))  # 23 hours
NY_FALL_DAY = (z(2026, 11, 1, 3, 59, 59), z(2026, 11, 2, 4, 59, 59))  # 25 hours
BER_SPRING_DAY = (z(2026, 3, 28, 22, 59, 59), z(2026, 3, 29, 21, 59, 59))  # 23 hours
BER_FALL_DAY = (z(2026, 10, 24, 21, 59, 59), z(2026, 10, 25, 22, 59, 59))  # 25 hours


@pytest.mark.parametrize(
    ("expression", "zone", "after", "expected"),
    [
        # 5 fields, strictly greater than `after`, sub-second `after`
        ("*/15 * * * *", "UTC", z(2026, 1, 1), z(2026, 1, 1, 0, 15)),
        ("*/15 * * * *", "UTC", z(2026, 1, 1, 0, 7, 30, 500000), z(2026, 1, 1, 0, 15)),
        ("*/15 * * * *", "UTC", z(2026, 1, 1, 0, 14, 59, 999999), z(2026, 1, 1, 0, 15)),
        ("*/15 * * * *", "UTC", z(2026, 1, 1, 0, 15, 0, 1), z(2026, 1, 1, 0, 30)),
        ("0 * * * *", "UTC", datetime(2026, 1, 1, 5, 30, tzinfo=ZoneInfo(IST)), z(2026, 1, 1, 1)),
        # 6 fields, seconds first
        ("*/5 * * * * *", "UTC", z(2026, 1, 1, 0, 0, 3), z(2026, 1, 1, 0, 0, 5)),
        ("*/5 * * * * *", "UTC", z(2026, 1, 1, 0, 0, 5), z(2026, 1, 1, 0, 0, 10)),
        ("*/5 * * * * *", "UTC", z(2026, 1, 1, 0, 0, 4, 999999), z(2026, 1, 1, 0, 0, 5)),
        ("*/5 * * * * *", "UTC", z(2026, 1, 1, 0, 0, 5, 1), z(2026, 1, 1, 0, 0, 10)),
        ("30 0 12 * * *", "UTC", z(2026, 1, 1), z(2026, 1, 1, 12, 0, 30)),
        ("*/5 * * * * *", NY, z(2026, 7, 1, 12, 0, 58), z(2026, 7, 1, 12, 1, 0)),
        # macros
        ("@yearly", "UTC", z(2026, 6, 15), z(2027, 1, 1)),
        ("@annually", BER, z(2026, 6, 15), z(2026, 12, 31, 23)),
        ("@monthly", "UTC", z(2026, 1, 31, 12), z(2026, 2, 1)),
        ("@weekly", "UTC", z(2026, 1, 1), z(2026, 1, 4)),  # 2026-01-01 is a Thursday
        ("@daily", IST, z(2026, 1, 1), z(2026, 1, 1, 18, 30)),
        ("@midnight", "UTC", z(2026, 1, 1), z(2026, 1, 2)),
        ("@hourly", IST, z(2026, 1, 1, 0, 10), z(2026, 1, 1, 0, 30)),
        ("@DAILY", "UTC", z(2026, 1, 1, 0, 0, 1), z(2026, 1, 2)),
        # zones
        ("0 9 * * 1-5", BER, z(2026, 1, 2, 9), z(2026, 1, 5, 8)),  # Friday 10:00 CET -> Monday 09:00 CET
        ("0 9 * * *", BER, z(2026, 7, 1), z(2026, 7, 1, 7)),  # 09:00 CEST
        ("30 8 * * *", IST, z(2026, 5, 10), z(2026, 5, 10, 3)),
        ("30 8 * * *", IST, z(2026, 5, 10, 3), z(2026, 5, 11, 3)),
        ("0 9 * * *", NY, z(2026, 1, 15, 14), z(2026, 1, 16, 14)),
        # day of month / day of week
        ("0 0 13 * 5", "UTC", z(2026, 1, 1), z(2026, 1, 2)),  # dom OR dow: Friday the 2nd
        ("0 12 1,15 * *", "UTC", z(2026, 1, 1, 12), z(2026, 1, 15, 12)),
        ("0 0 * * MON", "UTC", z(2026, 1, 1), z(2026, 1, 5)),
        ("0 6 1 JAN-MAR *", "UTC", z(2026, 3, 1, 6), z(2027, 1, 1, 6)),
        ("0 0 L 2 *", "UTC", z(2026, 1, 1), z(2026, 2, 28)),
        ("0 0 29 2 *", "UTC", z(2026, 1, 1), z(2028, 2, 29)),
        # DST gap, fixed hour: shifted to 03:00 EDT, after the shifted fire comes the next day
        ("30 2 * * *", NY, z(2026, 3, 8, 6, 59, 59), z(2026, 3, 8, 7)),
        ("30 2 * * *", NY, z(2026, 3, 8, 7), z(2026, 3, 9, 6, 30)),
        ("30 2 * * *", BER, z(2026, 3, 29), z(2026, 3, 29, 1)),
        # DST fold: `after` inside the fold, both passes
        ("*/30 * * * *", NY, z(2026, 11, 1, 5, 30), z(2026, 11, 1, 6)),
        ("*/30 * * * *", NY, z(2026, 11, 1, 5, 45), z(2026, 11, 1, 6)),
        ("*/30 * * * *", NY, z(2026, 11, 1, 6, 15), z(2026, 11, 1, 6, 30)),
        ("0 * * * *", NY, z(2026, 11, 1, 5), z(2026, 11, 1, 6)),
        ("30 1 * * *", NY, z(2026, 11, 1, 5, 30), z(2026, 11, 2, 6, 30)),
        ("30 1 * * *", NY, z(2026, 11, 1, 5), z(2026, 11, 1, 5, 30)),
        ("30 2 * * *", BER, z(2026, 10, 25), z(2026, 10, 25, 0, 30)),
        ("30 2 * * *", BER, z(2026, 10, 25, 0, 30), z(2026, 10, 26, 1, 30)),
    ],
)
def test_next_fire(expression: str, zone: str, after: datetime, expected: datetime) -> None:
    result = next_fire(validate_cron(expression, zone), after)
    assert result == expected
    assert result is not None and result.tzinfo is UTC and result.microsecond == 0


@pytest.mark.parametrize(
    ("expression", "zone", "gap", "fold", "after", "expected"),
    [
        ("30 2 * * *", NY, "skip", None, z(2026, 3, 7, 8), z(2026, 3, 9, 6, 30)),
        ("30 1 * * *", NY, None, "last", z(2026, 11, 1, 5, 30), z(2026, 11, 1, 6, 30)),
        ("30 1 * * *", NY, None, "last", z(2026, 11, 1, 6, 30), z(2026, 11, 2, 6, 30)),
        ("30 1 * * *", NY, None, "both", z(2026, 11, 1, 5, 45), z(2026, 11, 1, 6, 30)),
        ("30 1 * * *", NY, None, "both", z(2026, 11, 1, 6, 30), z(2026, 11, 2, 6, 30)),
        ("30 2 * * *", BER, None, "last", z(2026, 10, 25, 0, 30), z(2026, 10, 25, 1, 30)),
        ("0 * * * *", NY, None, "first", z(2026, 11, 1, 5), z(2026, 11, 1, 7)),
        ("30 * * * *", NY, "shift", None, z(2026, 3, 8, 6, 30), z(2026, 3, 8, 7)),
    ],
)
def test_next_fire_explicit_policy(
    expression: str, zone: str, gap: str | None, fold: str | None, after: datetime, expected: datetime
) -> None:
    schedule = validate_cron(expression, zone, dst_gap=gap, dst_fold=fold)
    assert next_fire(schedule, after) == expected


@pytest.mark.parametrize(
    ("expression", "zone", "gap", "fold", "window", "expected"),
    [
        # Fixed hour, whole local day. Spring forward: shift to 03:00 once, or skip.
        ("30 2 * * *", NY, None, None, NY_SPRING_DAY, [z(2026, 3, 8, 7)]),
        ("30 2 * * *", NY, "shift", None, NY_SPRING_DAY, [z(2026, 3, 8, 7)]),
        ("30 2 * * *", NY, "skip", None, NY_SPRING_DAY, []),
        ("*/15 2 * * *", NY, None, None, NY_SPRING_DAY, [z(2026, 3, 8, 7)]),
        ("30 1 * * *", NY, None, None, NY_SPRING_DAY, [z(2026, 3, 8, 6, 30)]),
        ("30 2 * * *", BER, None, None, BER_SPRING_DAY, [z(2026, 3, 29, 1)]),
        ("30 2 * * *", BER, "skip", None, BER_SPRING_DAY, []),
        ("30 1 * * *", BER, None, None, BER_SPRING_DAY, [z(2026, 3, 29, 0, 30)]),
        # Fixed hour, whole local day. Fall back: first, last or both passes.
        ("30 1 * * *", NY, None, None, NY_FALL_DAY, [z(2026, 11, 1, 5, 30)]),
        ("30 1 * * *", NY, None, "first", NY_FALL_DAY, [z(2026, 11, 1, 5, 30)]),
        ("30 1 * * *", NY, None, "last", NY_FALL_DAY, [z(2026, 11, 1, 6, 30)]),
        ("30 1 * * *", NY, None, "both", NY_FALL_DAY, [z(2026, 11, 1, 5, 30), z(2026, 11, 1, 6, 30)]),
        ("30 2 * * *", NY, None, None, NY_FALL_DAY, [z(2026, 11, 1, 7, 30)]),
        ("30 2 * * *", BER, None, None, BER_FALL_DAY, [z(2026, 10, 25, 0, 30)]),
        ("30 2 * * *", BER, None, "last", BER_FALL_DAY, [z(2026, 10, 25, 1, 30)]),
        ("30 2 * * *", BER, None, "both", BER_FALL_DAY, [z(2026, 10, 25, 0, 30), z(2026, 10, 25, 1, 30)]),
        ("30 1 * * *", BER, None, None, BER_FALL_DAY, [z(2026, 10, 24, 23, 30)]),
        # Hour not '*' but a list: fixed-hour defaults, 02:00 shifted to 03:00 EDT.
        ("0 */2 * * *", NY, None, None, (z(2026, 3, 8, 4, 59, 59), z(2026, 3, 8, 8)),
         [z(2026, 3, 8, 5), z(2026, 3, 8, 7), z(2026, 3, 8, 8)]),
        # Every hour around spring forward: the missing hour is skipped.
        ("0 * * * *", NY, None, None, (z(2026, 3, 8, 5), z(2026, 3, 8, 9)),
         [z(2026, 3, 8, 6), z(2026, 3, 8, 7), z(2026, 3, 8, 8), z(2026, 3, 8, 9)]),
        ("0 * * * *", NY, "shift", None, (z(2026, 3, 8, 5), z(2026, 3, 8, 9)),
         [z(2026, 3, 8, 6), z(2026, 3, 8, 7), z(2026, 3, 8, 8), z(2026, 3, 8, 9)]),
        ("0 0-23 * * *", NY, None, None, (z(2026, 3, 8, 5), z(2026, 3, 8, 9)),
         [z(2026, 3, 8, 6), z(2026, 3, 8, 7), z(2026, 3, 8, 8), z(2026, 3, 8, 9)]),
        ("0 0 * * * *", NY, None, None, (z(2026, 3, 8, 5), z(2026, 3, 8, 9)),
         [z(2026, 3, 8, 6), z(2026, 3, 8, 7), z(2026, 3, 8, 8), z(2026, 3, 8, 9)]),
        ("30 * * * *", NY, None, None, (z(2026, 3, 8, 5), z(2026, 3, 8, 9)),
         [z(2026, 3, 8, 5, 30), z(2026, 3, 8, 6, 30), z(2026, 3, 8, 7, 30), z(2026, 3, 8, 8, 30)]),
        ("30 * * * *", NY, "shift", None, (z(2026, 3, 8, 5), z(2026, 3, 8, 9)),
         [z(2026, 3, 8, 5, 30), z(2026, 3, 8, 6, 30), z(2026, 3, 8, 7), z(2026, 3, 8, 7, 30),
          z(2026, 3, 8, 8, 30)]),
        ("*/30 * * * *", NY, None, None, (z(2026, 3, 8, 5), z(2026, 3, 8, 8)),
         [z(2026, 3, 8, 5, 30), z(2026, 3, 8, 6), z(2026, 3, 8, 6, 30), z(2026, 3, 8, 7),
          z(2026, 3, 8, 7, 30), z(2026, 3, 8, 8)]),
        ("0 * * * *", BER, None, None, (z(2026, 3, 28, 23), z(2026, 3, 29, 3)),
         [z(2026, 3, 29, 0), z(2026, 3, 29, 1), z(2026, 3, 29, 2), z(2026, 3, 29, 3)]),
        ("*/30 * * * *", BER, None, None, (z(2026, 3, 28, 23), z(2026, 3, 29, 2)),
         [z(2026, 3, 28, 23, 30), z(2026, 3, 29, 0), z(2026, 3, 29, 0, 30), z(2026, 3, 29, 1),
          z(2026, 3, 29, 1, 30), z(2026, 3, 29, 2)]),
        ("30 * * * *", BER, None, None, (z(2026, 3, 28, 23), z(2026, 3, 29, 3)),
         [z(2026, 3, 28, 23, 30), z(2026, 3, 29, 0, 30), z(2026, 3, 29, 1, 30), z(2026, 3, 29, 2, 30)]),
        ("30 * * * *", BER, "shift", None, (z(2026, 3, 28, 23), z(2026, 3, 29, 3)),
         [z(2026, 3, 28, 23, 30), z(2026, 3, 29, 0, 30), z(2026, 3, 29, 1), z(2026, 3, 29, 1, 30),
          z(2026, 3, 29, 2, 30)]),
        # Every hour around fall back: both passes run by default.
        ("0 * * * *", NY, None, None, (z(2026, 11, 1, 4), z(2026, 11, 1, 8)),
         [z(2026, 11, 1, 5), z(2026, 11, 1, 6), z(2026, 11, 1, 7), z(2026, 11, 1, 8)]),
        ("0 * * * *", NY, None, "first", (z(2026, 11, 1, 4), z(2026, 11, 1, 8)),
         [z(2026, 11, 1, 5), z(2026, 11, 1, 7), z(2026, 11, 1, 8)]),
        ("0 * * * *", NY, None, "last", (z(2026, 11, 1, 4), z(2026, 11, 1, 8)),
         [z(2026, 11, 1, 6), z(2026, 11, 1, 7), z(2026, 11, 1, 8)]),
        ("*/30 * * * *", NY, None, None, (z(2026, 11, 1, 4), z(2026, 11, 1, 7)),
         [z(2026, 11, 1, 4, 30), z(2026, 11, 1, 5), z(2026, 11, 1, 5, 30), z(2026, 11, 1, 6),
          z(2026, 11, 1, 6, 30), z(2026, 11, 1, 7)]),
        ("*/30 * * * *", NY, None, "first", (z(2026, 11, 1, 4), z(2026, 11, 1, 7)),
         [z(2026, 11, 1, 4, 30), z(2026, 11, 1, 5), z(2026, 11, 1, 5, 30), z(2026, 11, 1, 7)]),
        ("*/30 * * * *", NY, None, "last", (z(2026, 11, 1, 4), z(2026, 11, 1, 7)),
         [z(2026, 11, 1, 4, 30), z(2026, 11, 1, 6), z(2026, 11, 1, 6, 30), z(2026, 11, 1, 7)]),
        ("0 * * * *", BER, None, None, (z(2026, 10, 24, 23), z(2026, 10, 25, 3)),
         [z(2026, 10, 25, 0), z(2026, 10, 25, 1), z(2026, 10, 25, 2), z(2026, 10, 25, 3)]),
        ("0 * * * *", BER, None, "first", (z(2026, 10, 24, 23), z(2026, 10, 25, 3)),
         [z(2026, 10, 25, 0), z(2026, 10, 25, 2), z(2026, 10, 25, 3)]),
        ("0 * * * *", BER, None, "last", (z(2026, 10, 24, 23), z(2026, 10, 25, 3)),
         [z(2026, 10, 25, 1), z(2026, 10, 25, 2), z(2026, 10, 25, 3)]),
        ("*/30 * * * *", BER, None, None, (z(2026, 10, 24, 23), z(2026, 10, 25, 2)),
         [z(2026, 10, 24, 23, 30), z(2026, 10, 25, 0), z(2026, 10, 25, 0, 30), z(2026, 10, 25, 1),
          z(2026, 10, 25, 1, 30), z(2026, 10, 25, 2)]),
        ("*/30 * * * *", BER, None, "first", (z(2026, 10, 24, 23), z(2026, 10, 25, 2)),
         [z(2026, 10, 24, 23, 30), z(2026, 10, 25, 0), z(2026, 10, 25, 0, 30), z(2026, 10, 25, 2)]),
    ],
)
def test_fire_times_on_dst_days(
    expression: str,
    zone: str,
    gap: str | None,
    fold: str | None,
    window: tuple[datetime, datetime],
    expected: list[datetime],
) -> None:
    schedule = validate_cron(expression, zone, dst_gap=gap, dst_fold=fold)
    assert fire_times(schedule, *window, limit=1000) == expected


@pytest.mark.parametrize(
    ("expression", "zone", "fold", "window", "count"),
    [
        ("0 * * * *", NY, None, NY_SPRING_DAY, 23),
        ("*/30 * * * *", NY, None, NY_SPRING_DAY, 46),
        ("0 * * * *", NY, None, NY_FALL_DAY, 25),
        ("*/30 * * * *", NY, None, NY_FALL_DAY, 50),
        ("0 * * * *", NY, "first", NY_FALL_DAY, 24),
        ("*/30 * * * *", NY, "last", NY_FALL_DAY, 48),
        ("0 * * * *", BER, None, BER_SPRING_DAY, 23),
        ("*/30 * * * *", BER, None, BER_SPRING_DAY, 46),
        ("0 * * * *", BER, None, BER_FALL_DAY, 25),
        ("*/30 * * * *", BER, None, BER_FALL_DAY, 50),
        ("0 0 * * * *", BER, None, BER_FALL_DAY, 25),
        ("0 * * * *", IST, None, (z(2026, 3, 7, 18, 29, 59), z(2026, 3, 8, 18, 29, 59)), 24),
    ],
)
def test_every_hour_counts_over_dst_days(
    expression: str, zone: str, fold: str | None, window: tuple[datetime, datetime], count: int
) -> None:
    fires = fire_times(validate_cron(expression, zone, dst_fold=fold), *window, limit=1000)
    assert len(fires) == count
    assert fires == sorted(set(fires))


@pytest.mark.parametrize(
    ("expression", "zone", "window"),
    [
        ("*/30 * * * *", NY, NY_FALL_DAY),
        ("*/30 * * * *", BER, BER_FALL_DAY),
        ("*/30 * * * *", BER, BER_SPRING_DAY),
        ("*/15 2 * * *", NY, NY_SPRING_DAY),
    ],
)
def test_chained_next_fire_matches_fire_times(
    expression: str, zone: str, window: tuple[datetime, datetime]
) -> None:
    schedule = validate_cron(expression, zone)
    chained: list[datetime] = []
    cursor = next_fire(schedule, window[0])
    while cursor is not None and cursor <= window[1]:
        chained.append(cursor)
        cursor = next_fire(schedule, cursor)
    assert chained == fire_times(schedule, *window, limit=1000)


def test_fire_times_limit_and_bounds() -> None:
    schedule = validate_cron("*/5 * * * * *")
    assert fire_times(schedule, z(2026, 1, 1), z(2026, 1, 2), limit=3) == [
        z(2026, 1, 1, 0, 0, 5),
        z(2026, 1, 1, 0, 0, 10),
        z(2026, 1, 1, 0, 0, 15),
    ]
    assert fire_times(schedule, z(2026, 1, 1), z(2026, 1, 1, 0, 0, 10), limit=10) == [
        z(2026, 1, 1, 0, 0, 5),
        z(2026, 1, 1, 0, 0, 10),
    ]
    assert fire_times(schedule, z(2026, 1, 1), z(2026, 1, 1, 0, 0, 9, 999999), limit=10) == [
        z(2026, 1, 1, 0, 0, 5)
    ]
    assert fire_times(schedule, z(2026, 1, 1), z(2026, 1, 2), limit=0) == []
    assert fire_times(schedule, z(2026, 1, 2), z(2026, 1, 1), limit=10) == []


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("", "cron expression is empty"),
        ("   ", "cron expression is empty"),
        ("61 * * * *", "bad minute field '61' (expected 0-59"),
        ("* 24 * * *", "bad hour field '24' (expected 0-23"),
        ("* * 32 * *", "bad day-of-month field '32' (expected 1-31"),
        ("* * 0 * *", "bad day-of-month field '0'"),
        ("* * * 13 *", "bad month field '13' (expected 1-12 or JAN-DEC"),
        ("* * * * 8", "bad day-of-week field '8' (expected 0-7 or SUN-SAT"),
        ("60 * * * * *", "bad second field '60' (expected 0-59"),
        ("*/0 * * * *", "bad minute field '*/0'"),
        ("5,,6 * * * *", "bad minute field '5,,6'"),
        ("a b c d e", "bad minute field 'a'"),
        ("0 0 1 1 * 2030", "bad day-of-week field '2030'"),
        ("* * * *", "expected 5 fields (minute hour day-of-month month day-of-week) or 6 fields"),
        ("* * * * * * *", "got 7"),
        ("hello world", "got 2"),
        ("@reboot", "unsupported cron macro '@reboot'; supported: @yearly"),
        ("@fortnightly", "unsupported cron macro '@fortnightly'"),
        ("H * * * *", "hashed (H) and random (R) not supported"),
        ("R * * * *", "hashed (H) and random (R) not supported"),
    ],
)
def test_invalid_expressions(expression: str, message: str) -> None:
    with pytest.raises(CronError, match=re.escape(message)):
        validate_cron(expression)


@pytest.mark.parametrize("expression", ["0 0 30 2 *", "0 0 31 4 *", "0 0 31 2,4,6,9,11 *", "0 0 0 30 2 *"])
def test_never_firing_expressions(expression: str) -> None:
    with pytest.raises(CronError, match=re.escape(f"cron expression '{expression}' never fires")):
        validate_cron(expression, NY)


def test_next_fire_none_when_never_fires() -> None:
    assert next_fire(CronSchedule("0 0 30 2 *", "UTC"), z(2026, 1, 1)) is None
    assert fire_times(CronSchedule("0 0 31 4 *", BER), z(2026, 1, 1), z(2030, 1, 1), limit=5) == []


@pytest.mark.parametrize(
    "name",
    ["Mars/Base", "", "../etc/passwd", "/etc/localtime", "localtime", "America/New_York ", "america/new_york",
     "UTC/../UTC", "Europe\\Berlin", "America/../UTC"],
)
def test_unknown_time_zones(name: str) -> None:
    with pytest.raises(TimezoneError, match=re.escape(f"unknown time zone {name!r}")):
        parse_timezone(name)
    with pytest.raises(TimezoneError):
        validate_cron("0 * * * *", name)


def test_parse_timezone_is_cached() -> None:
    zone = parse_timezone(IST)
    assert zone.key == IST
    assert parse_timezone(IST) is zone
    assert parse_timezone.cache_info().hits >= 1


def test_validate_cron_result() -> None:
    assert validate_cron("  */5   *  * * * ", BER) == CronSchedule("*/5 * * * *", BER)
    assert validate_cron("@hourly") == CronSchedule("@hourly", "UTC")
    assert isinstance(CronError("x"), ValueError) and isinstance(TimezoneError("x"), ValueError)


@pytest.mark.parametrize(("gap", "fold"), [("later", None), (None, "middle"), ("", None)])
def test_invalid_dst_policy(gap: str | None, fold: str | None) -> None:
    with pytest.raises(CronError, match="invalid dst_"):
        CronSchedule("0 * * * *", "UTC", dst_gap=gap, dst_fold=fold)


def test_next_fire_rejects_naive_datetime() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        next_fire(validate_cron("0 * * * *"), datetime(2026, 1, 1))


def test_next_fire_is_cached_per_second() -> None:
    schedule = validate_cron("*/15 * * * *", BER)
    next_fire.cache_clear()  # type: ignore[attr-defined]
    first = next_fire(schedule, z(2026, 1, 1, 0, 0, 0, 100))
    second = next_fire(schedule, z(2026, 1, 1, 0, 0, 0, 900000))  # same second: same key
    third = next_fire(CronSchedule("*/15 * * * *", BER), z(2026, 1, 1))  # equal schedule object
    assert first == second == third == z(2026, 1, 1, 0, 15)
    info = next_fire.cache_info()  # type: ignore[attr-defined]
    assert (info.hits, info.misses) == (2, 1)
    assert info.maxsize >= 100_000


def test_validation_goes_through_the_cache() -> None:
    validate_cron("7 * * * *", "Asia/Tokyo")
    before = next_fire.cache_info()  # type: ignore[attr-defined]
    validate_cron("7 * * * *", "Asia/Tokyo")
    after = next_fire.cache_info()  # type: ignore[attr-defined]
    assert (after.hits - before.hits, after.misses - before.misses) == (1, 0)


# Debian cron's reading of ranges, steps and the day fields (docs/semantics.md, "Cron expressions").


@pytest.mark.parametrize(
    ("expression", "window", "expected"),
    [
        ("30-30 2 * * *", (z(2026, 1, 1), z(2026, 1, 2, 23, 59)), [z(2026, 1, 1, 2, 30), z(2026, 1, 2, 2, 30)]),
        ("5-5 * * * *", (z(2026, 1, 1), z(2026, 1, 1, 3)),
         [z(2026, 1, 1, 0, 5), z(2026, 1, 1, 1, 5), z(2026, 1, 1, 2, 5)]),
        ("0 0 5-5 * *", (z(2026, 1, 1), z(2026, 3, 1)), [z(2026, 1, 5), z(2026, 2, 5)]),
        ("0 0 * * WED-WED", (z(2026, 1, 1), z(2026, 1, 15)), [z(2026, 1, 7), z(2026, 1, 14)]),
        ("0 15-15/5 * * * *", (z(2026, 1, 1), z(2026, 1, 1, 0, 30)), [z(2026, 1, 1, 0, 15)]),
    ],
)
def test_single_value_range_is_that_value_only(
    expression: str, window: tuple[datetime, datetime], expected: list[datetime]
) -> None:
    assert fire_times(validate_cron(expression), *window, limit=100) == expected


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        # A day field beginning with '*' (also */n): both must match. Days 1, 11, 21, 31 that are Fridays.
        ("0 2 */10 * 5", [z(2026, 5, 1, 2), z(2026, 7, 31, 2), z(2026, 8, 21, 2), z(2026, 9, 11, 2)]),
        ("0 2 1 * */5", [z(2026, 2, 1, 2), z(2026, 3, 1, 2), z(2026, 5, 1, 2)]),  # Sundays or Fridays the 1st
        ("0 0 *,13 * 5", [z(2026, 1, 2), z(2026, 1, 9), z(2026, 1, 16)]),  # every day AND Friday
        # Neither begins with '*': either matches (Friday the 2nd, then the 9th and the 13th).
        ("0 0 13 * 5", [z(2026, 1, 2), z(2026, 1, 9), z(2026, 1, 13)]),
        ("0 0 1-31 * 5", [z(2026, 1, 1), z(2026, 1, 2), z(2026, 1, 3)]),
        ("0 0 1-7 * 5#1", [z(2026, 1, 1), z(2026, 1, 2), z(2026, 1, 3)]),  # also with # (croniter: AND)
        ("0 0 L * 5#1", [z(2026, 1, 2), z(2026, 1, 31), z(2026, 2, 6)]),
    ],
)
def test_day_fields_and_when_either_begins_with_a_star(expression: str, expected: list[datetime]) -> None:
    assert fire_times(validate_cron(expression), z(2025, 12, 31, 23), z(2026, 12, 31), limit=len(expected)) == expected


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        # 1/2 is 1-7/2: Monday, Wednesday, Friday and Sunday (7). 2026-01-01 is a Thursday.
        ("0 0 * * 1/2", [z(2026, 1, 2), z(2026, 1, 4), z(2026, 1, 5), z(2026, 1, 7)]),
        ("0 0 * * FRI/2", [z(2026, 1, 2), z(2026, 1, 4), z(2026, 1, 9), z(2026, 1, 11)]),
        ("0 0 * * */3", [z(2026, 1, 3), z(2026, 1, 4), z(2026, 1, 7), z(2026, 1, 10)]),  # 0, 3, 6
        ("0 0 * * 5-7", [z(2026, 1, 2), z(2026, 1, 3), z(2026, 1, 4), z(2026, 1, 9)]),
        ("0 0 * 11/5 *", [z(2026, 11, 1), z(2026, 11, 2), z(2026, 11, 3), z(2026, 11, 4)]),  # 11 only
    ],
)
def test_start_with_step_runs_to_the_field_maximum(expression: str, expected: list[datetime]) -> None:
    assert fire_times(validate_cron(expression), z(2026, 1, 1), z(2027, 1, 1), limit=len(expected)) == expected


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        # Extensions croniter read before the Debian engine; stored jobs keep their meaning.
        ("0 0 L * *", [z(2026, 1, 31), z(2026, 2, 28), z(2026, 3, 31)]),
        ("0 0 LW * *", [z(2026, 1, 30), z(2026, 2, 27), z(2026, 3, 31)]),
        ("0 0 15W * *", [z(2026, 1, 15), z(2026, 2, 16), z(2026, 3, 16)]),  # Feb 15 is a Sunday
        ("0 0 1W * *", [z(2026, 2, 2), z(2026, 3, 2), z(2026, 4, 1)]),  # never back into the last month
        ("0 0 31W * *", [z(2026, 1, 30), z(2026, 2, 27), z(2026, 3, 31)]),  # the month's last day
        ("0 0 10-L/10 * *", [z(2026, 1, 10), z(2026, 1, 20), z(2026, 1, 30)]),
        ("0 0 * * L5", [z(2026, 1, 30), z(2026, 2, 27), z(2026, 3, 27)]),
        ("0 0 * * 5L", [z(2026, 1, 30), z(2026, 2, 27), z(2026, 3, 27)]),
        ("0 0 * * 5#2", [z(2026, 1, 9), z(2026, 2, 13), z(2026, 3, 13)]),
        ("0 0 * * sun#1,7#3", [z(2026, 1, 4), z(2026, 1, 18), z(2026, 2, 1)]),
        ("0 0 ? * 1", [z(2026, 1, 5), z(2026, 1, 12), z(2026, 1, 19)]),
        ("0 22-1 * * *", [z(2026, 1, 1, 1), z(2026, 1, 1, 22), z(2026, 1, 1, 23)]),  # wraps around
        ("0 0 * * 6-0", [z(2026, 1, 3), z(2026, 1, 4), z(2026, 1, 10)]),
        # A wrapped day-of-week step goes round the seven days once: Friday and Sunday, never Monday.
        ("0 0 * * 5-1/2", [z(2026, 1, 2), z(2026, 1, 4), z(2026, 1, 9)]),
        ("0 0 * * fri-mon/2", [z(2026, 1, 2), z(2026, 1, 4), z(2026, 1, 9)]),
        ("0 0 * * 7-1", [z(2026, 1, 4), z(2026, 1, 5), z(2026, 1, 11)]),
        ("0 0 1 jan-MAR/2 *", [z(2026, 3, 1), z(2027, 1, 1), z(2027, 3, 1)]),
    ],
)
def test_extensions(expression: str, expected: list[datetime]) -> None:
    assert fire_times(validate_cron(expression), z(2026, 1, 1), z(2030, 1, 1), limit=3) == expected


@pytest.mark.parametrize(
    ("expression", "zone", "after", "expected"),
    [
        # The fifth Friday of February is a Feb 29 that is a Friday: 28 years apart, or 40 across 2100.
        ("0 0 * 2 5#5", "UTC", z(2026, 1, 1), z(2036, 2, 29)),
        ("0 0 * 2 5#5", "UTC", z(2093, 1, 1), z(2104, 2, 29)),
        ("0 0 * 2 1#5", "UTC", z(2073, 1, 1), z(2112, 2, 29)),
        ("0 0 29 2 *", NY, z(2096, 3, 1), z(2104, 2, 29, 5)),
        ("0 0 29 2 */7", "UTC", z(2026, 1, 1), z(2032, 2, 29)),  # AND: a Feb 29 that is a Sunday
        # Neither day field begins with '*', so either matches: Feb 29, or February's fifth Friday.
        ("0 0 29 2 5#5", "UTC", z(2026, 1, 1), z(2028, 2, 29)),
    ],
)
def test_rare_schedules_are_found_years_ahead(expression: str, zone: str, after: datetime, expected: datetime) -> None:
    assert next_fire(validate_cron(expression, zone), after) == expected


@pytest.mark.parametrize(
    ("expression", "zone", "gap"),
    [
        ("0 0 * 2 1#5", "UTC", None),
        ("0 0 29 2 *", "Australia/Lord_Howe", "skip"),
        ("30 2 * 3 0#2", NY, None),
        ("0 0 * * 0", "America/Santiago", "skip"),  # midnight is skipped on some Sundays only
        ("*/5 * * * * *", "UTC", None),
    ],
)
def test_accepted_schedules_fire_from_any_instant(expression: str, zone: str, gap: str | None) -> None:
    schedule = validate_cron(expression, zone, dst_gap=gap)
    for year in (1970, 2026, 2099, 2101, 2500, 9000):
        assert next_fire(schedule, z(year, 1, 1)) is not None


def test_a_wall_time_the_clock_always_skips_never_fires() -> None:
    # 02:30 on the second Sunday of March is inside New York's spring-forward gap every year.
    with pytest.raises(CronError, match=re.escape("cron expression '30 2 * 3 0#2' never fires")):
        validate_cron("30 2 * 3 0#2", NY, dst_gap="skip")
    assert validate_cron("30 2 * 3 0#2", NY) == CronSchedule("30 2 * 3 0#2", NY)  # shifted to 03:00
    assert next_fire(validate_cron("30 2 * 3 0#2", NY), z(2026, 1, 1)) == z(2026, 3, 8, 7)
