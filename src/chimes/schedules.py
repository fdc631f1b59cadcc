"""Recurring schedules of every kind, as one object the scheduler asks for its next fire.

A recurring job fires on a *rule*, either a cron expression in a time zone (chimes.cron) or a fixed
interval, optionally held between a ``start_at`` and an ``end_at``. The slot machinery (chimes.slots,
chimes.scheduler.firing) asks only :func:`next_fire` and :func:`fire_times`, so every rule gets the
same catch-up, jitter and concurrency handling.

Intervals are anchored to a fixed origin, the Unix epoch plus the phase: the fires are the instants
``k * every + phase`` seconds after 1970-01-01T00:00Z. They never drift, whatever time the job was
created, edited or resumed, and every node computes the same ones. Elapsed time, not wall time: a DST
change in any zone neither adds nor drops a fire.

Pure functions: no clock, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from chimes import cron

MIN_INTERVAL_SEC = 1  # as often as a 6-field cron expression can fire
MAX_INTERVAL_SEC = 366 * 86400
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_SECOND = timedelta(seconds=1)
_DURATION = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")
_UNIT_SEC = (86400, 3600, 60, 1)


class ScheduleError(ValueError):
    """An invalid schedule; the message is meant for API users."""


def parse_duration(text: str) -> int:
    """Seconds in a duration such as ``90m``, ``1h30m``, ``2d`` or ``45s`` (units d, h, m, s, largest first)."""
    match = _DURATION.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None or not any(match.groups()):
        raise ScheduleError(f"invalid duration {text!r}: expected a number with a unit, largest first, "
                            "such as 90m, 1h30m, 2d or 45s")
    return sum(int(part) * unit for part, unit in zip(match.groups(), _UNIT_SEC, strict=True) if part)


def format_duration(seconds: int) -> str:
    """The shortest duration text for ``seconds`` (``5400`` -> ``1h30m``); ``0s`` for zero."""
    parts = []
    for unit, name in zip(_UNIT_SEC, "dhms", strict=True):
        count, seconds = divmod(seconds, unit)
        if count:
            parts.append(f"{count}{name}")
    return "".join(parts) or "0s"


@dataclass(frozen=True, slots=True)
class IntervalSchedule:
    """Every ``every_sec`` seconds, at ``phase_sec`` past each multiple of it counted from the epoch."""

    every_sec: int
    phase_sec: int = 0

    def __post_init__(self) -> None:
        if not MIN_INTERVAL_SEC <= self.every_sec <= MAX_INTERVAL_SEC:
            raise ScheduleError(f"interval must be between {MIN_INTERVAL_SEC} s and {MAX_INTERVAL_SEC} s "
                                f"(366 days), got {self.every_sec} s")
        if not 0 <= self.phase_sec < self.every_sec:
            raise ScheduleError(f"phase must be at least 0 and less than the interval ({self.every_sec} s), "
                                f"got {self.phase_sec} s")


Rule = cron.CronSchedule | IntervalSchedule


@dataclass(frozen=True, slots=True)
class Recurrence:
    """A recurring schedule: its rule and the bounds it fires within (both inclusive; None: open)."""

    rule: Rule
    start_at: datetime | None = None
    end_at: datetime | None = None


def recurrence_of(cron_expression: str | None, timezone: str | None, *, dst_gap: str | None, dst_fold: str | None,
                  every_sec: int | None, phase_sec: int | None, start_at: datetime | None = None,
                  end_at: datetime | None = None) -> Recurrence | None:
    """The recurring schedule a job's stored columns describe; None for a one-off job."""
    rule: Rule
    if every_sec is not None:
        rule = IntervalSchedule(every_sec, phase_sec or 0)
    elif cron_expression is not None:
        rule = cron.CronSchedule(cron_expression, timezone or "UTC", dst_gap, dst_fold)
    else:
        return None
    return Recurrence(rule, start_at, end_at)


def _next_interval(rule: IntervalSchedule, after: datetime) -> datetime:
    # Fires are whole seconds, so t > after exactly when t > floor(after).
    after_s = (after - _EPOCH) // _SECOND
    k = (after_s - rule.phase_sec) // rule.every_sec + 1
    return _EPOCH + (k * rule.every_sec + rule.phase_sec) * _SECOND


def _next_of_rule(rule: Rule, after: datetime) -> datetime | None:
    if isinstance(rule, IntervalSchedule):
        return _next_interval(rule, after)
    return cron.next_fire(rule, after)


def next_fire(schedule: Recurrence, after: datetime) -> datetime | None:
    """First fire strictly after ``after`` within the bounds, aware UTC; None once past ``end_at``
    (or when the rule never fires again)."""
    start = schedule.start_at
    following = _next_of_rule(schedule.rule, after if start is None else max(after, start - _SECOND))
    while following is not None and start is not None and following < start:
        following = _next_of_rule(schedule.rule, following)
    if following is None or (schedule.end_at is not None and following > schedule.end_at):
        return None
    return following


def fire_times(schedule: Recurrence, start: datetime, end: datetime, limit: int) -> list[datetime]:
    """All fires t with start < t <= end, ascending aware UTC, at most ``limit``."""
    found: list[datetime] = []
    cursor = start
    while len(found) < limit:
        following = next_fire(schedule, cursor)
        if following is None or following > end:
            break
        found.append(following)
        cursor = following
    return found


def capped(schedule: Recurrence, first: datetime, remaining: int, until: datetime) -> Recurrence:
    """The schedule ending at its ``remaining``-th slot counted from ``first`` (the first of them)
    when that slot is at or before ``until``: a run cap (schedule.maxRuns) is an end the slots reach.
    Walks at most the slots up to ``until``, as planning a fire does anyway."""
    last: datetime | None = first
    for _ in range(remaining - 1):
        last = next_fire(schedule, last) if last is not None else None
        if last is None or last > until:
            return schedule
    if last is None or (schedule.end_at is not None and schedule.end_at <= last):
        return schedule
    return replace(schedule, end_at=last)


def describe(rule: Rule) -> str:
    """The rule in a few words, for the CLI and the dashboard."""
    if isinstance(rule, IntervalSchedule):
        phase = f" +{format_duration(rule.phase_sec)}" if rule.phase_sec else ""
        return f"every {format_duration(rule.every_sec)}{phase}"
    return f"{rule.expression} ({rule.timezone})"


def wire_text(schedule: Mapping[str, Any]) -> str:
    """A recurring schedule in its wire form, in a few words: ``*/5 * * * * (UTC)``, ``every 1h30m +15m``,
    with its bounds (``from ... until ...``) when it has them."""
    if "everySec" in schedule:
        text = describe(IntervalSchedule(int(schedule["everySec"]), int(schedule.get("phaseSec") or 0)))
    else:
        text = f"{schedule.get('cron', '')} ({schedule.get('timezone') or 'UTC'})"
    for key, word in (("startAt", "from"), ("endAt", "until")):
        if schedule.get(key):
            moment = schedule[key]
            text += f" {word} {moment.isoformat() if isinstance(moment, datetime) else moment}"
    return text
