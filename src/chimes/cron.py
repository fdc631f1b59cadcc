"""Cron expressions in IANA time zones, resolved to UTC fire instants.

Pure functions: no I/O and no clock reads, so callers (scheduler, API validation) pass ``after``.

Syntax: 5 fields (minute hour day-of-month month day-of-week), 6 fields with the *seconds first*,
or one of the macros @yearly @annually @monthly @weekly @daily @midnight @hourly. When both
day-of-month and day-of-week are restricted a day matches either (Vixie cron OR rule).
Hashed/random fields (``H``, ``R``) are rejected: a schedule must be deterministic to be cached.

DST semantics (following Vixie/Debian cron). croniter iterates naive wall-clock times in the job's
zone; each wall time is mapped to UTC here with an explicit policy:

* Fixed-hour expressions (hour field not every hour, e.g. ``30 2 * * *``):
    - a wall time inside a spring-forward gap is, by default, ``shift``-ed to the first valid
      instant after the gap (02:30 on 2026-03-08 in America/New_York runs at 03:00 EDT = 07:00Z),
      exactly once even if several fire times fall in the gap; ``skip`` drops it;
    - a wall time inside a fall-back fold runs, by default, at the ``first`` occurrence only
      (01:30 EDT); ``last`` picks the second (01:30 EST); ``both`` runs twice.
* Every-hour expressions (``*/15 * * * *``, ``0 * * * *``, ``*/5 * * * * *``) follow elapsed time by
  default: gap wall times are skipped (no stampede at 03:00) and both fold occurrences run (no
  hour without runs). Explicit ``dst_gap``/``dst_fold`` on the schedule override both defaults.

Fire instants are whole seconds; ``next_fire`` is strictly greater than ``after`` in absolute
time, so iterating it over a fold neither repeats nor skips an instant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import NamedTuple
from zoneinfo import ZoneInfo, available_timezones

from croniter import croniter
from croniter.croniter import CroniterBadDateError, CroniterError

# Long enough that Feb 29 always fires (2096 -> 2104 skips the non-leap 2100).
_HORIZON_YEARS = 9
_HORIZON = timedelta(days=366 * _HORIZON_YEARS)
# Fixed origin for the "never fires" check: validation must not read the clock.
_REFERENCE = datetime(2000, 1, 1)
_EPOCH = datetime(1970, 1, 1)  # naive UTC, like all internal instants
_SECOND = timedelta(seconds=1)
_MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_RANGES = {"second": "0-59", "minute": "0-59", "hour": "0-23", "day-of-month": "1-31",
           "month": "1-12 or JAN-DEC", "day-of-week": "0-7 or SUN-SAT"}
_FIELDS = {5: tuple(_RANGES)[1:], 6: tuple(_RANGES)}
_NONDETERMINISTIC = re.compile(r"(?<![a-z])[hr](?![a-z])")
_ZONE_NAME = re.compile(r"[A-Za-z0-9_+-]+(/[A-Za-z0-9_+-]+)*")
_UTC_KEYS = frozenset({"UTC", "Etc/UTC", "GMT", "Etc/GMT"})
_GAP_POLICIES = frozenset({"shift", "skip"})
_FOLD_POLICIES = frozenset({"first", "last", "both"})


class CronError(ValueError):
    """Invalid or never-firing cron expression; the message is meant for API users."""


class TimezoneError(ValueError):
    """Unknown IANA time zone name; the message is meant for API users."""


@dataclass(frozen=True, slots=True)
class CronSchedule:
    """A validated cron schedule; hashable, so it can be part of cache keys."""

    expression: str
    timezone: str
    dst_gap: str | None = None  # None = automatic, "shift" | "skip"
    dst_fold: str | None = None  # None = automatic, "first" | "last" | "both"

    def __post_init__(self) -> None:
        if self.dst_gap is not None and self.dst_gap not in _GAP_POLICIES:
            raise CronError(f"invalid dst_gap {self.dst_gap!r}: expected 'shift' or 'skip'")
        if self.dst_fold is not None and self.dst_fold not in _FOLD_POLICIES:
            raise CronError(f"invalid dst_fold {self.dst_fold!r}: expected 'first', 'last' or 'both'")


class _Parsed(NamedTuple):
    fields: str  # 5 or 6 plain fields, macros expanded
    seconds: bool  # 6-field form, seconds first
    every_hour: bool  # hour field covers all 24 hours -> elapsed-time DST defaults


@lru_cache(maxsize=1)
def _known_zones() -> frozenset[str]:
    # "localtime" is a host symlink some systems ship in the tz directory, not an IANA name.
    return frozenset(available_timezones() - {"localtime"})


@lru_cache(maxsize=1024)
def parse_timezone(name: str) -> ZoneInfo:
    """Resolve an IANA zone name; the name check keeps paths like '../etc' away from the loader."""
    if not isinstance(name, str) or not _ZONE_NAME.fullmatch(name) or name not in _known_zones():
        raise TimezoneError(f"unknown time zone {name!r}")
    return ZoneInfo(name)


def _bad_field(fields: list[str], seconds: bool) -> str:
    """Name the first field croniter rejects on its own, so the error points at it."""
    names = _FIELDS[len(fields)]
    for i, field in enumerate(fields):
        probe = " ".join(field if j == i else "*" for j in range(len(fields)))
        try:
            croniter(probe, _REFERENCE, second_at_beginning=seconds)
        except CroniterError:
            return f"bad {names[i]} field {field!r} (expected {_RANGES[names[i]]}, lists, ranges, steps)"
    return "fields are inconsistent"


@lru_cache(maxsize=4096)
def _parse(expression: str) -> _Parsed:
    """Check the syntax once per distinct expression and expand macros."""
    text = " ".join(expression.split())
    if not text:
        raise CronError("cron expression is empty")
    if text.startswith("@"):
        if text.lower() not in _MACROS:
            raise CronError(f"unsupported cron macro {text!r}; supported: {', '.join(_MACROS)}")
        text = _MACROS[text.lower()]
    fields = text.split(" ")
    if len(fields) not in _FIELDS:
        raise CronError(
            f"invalid cron expression {expression!r}: expected 5 fields (minute hour day-of-month month"
            f" day-of-week) or 6 fields (second first), got {len(fields)}"
        )
    if _NONDETERMINISTIC.search(text.lower()):
        raise CronError(f"invalid cron expression {expression!r}: hashed (H) and random (R) not supported")
    seconds = len(fields) == 6
    try:
        hours = croniter(text, _REFERENCE, second_at_beginning=seconds).expanded[1]
    except CroniterError as exc:
        raise CronError(f"invalid cron expression {expression!r}: {_bad_field(fields, seconds)}") from exc
    return _Parsed(text, seconds, hours == ["*"] or len(set(hours)) == 24)


def validate_cron(
    expression: str, timezone: str = "UTC", *, dst_gap: str | None = None, dst_fold: str | None = None
) -> CronSchedule:
    """Validate user input up front, so that a stored schedule always has a next fire."""
    parse_timezone(timezone)
    schedule = CronSchedule(" ".join(expression.split()), timezone, dst_gap, dst_fold)
    _parse(schedule.expression)
    # Through the next-fire cache: bulk imports validate the same few expressions a million times.
    if _next_fire_cached(schedule, (_REFERENCE - _EPOCH) // _SECOND) is None:
        raise CronError(f"cron expression {schedule.expression!r} never fires")
    return schedule


def _transition(lo: datetime, hi: datetime, zone: ZoneInfo) -> datetime:
    """First naive-UTC second in (lo, hi] whose offset differs from lo's: the end of a DST gap."""
    before = lo.replace(tzinfo=UTC).astimezone(zone).utcoffset()
    lo_s, hi_s = 0, (hi - lo) // _SECOND
    while hi_s - lo_s > 1:
        mid = (lo_s + hi_s) // 2
        if (lo + mid * _SECOND).replace(tzinfo=UTC).astimezone(zone).utcoffset() == before:
            lo_s = mid
        else:
            hi_s = mid
    return lo + hi_s * _SECOND


def _images(wall: datetime, zone: ZoneInfo, gap: str, fold: str) -> tuple[datetime, ...]:
    """Naive-UTC instants for one naive wall time, ascending, under the given DST policy."""
    off0 = wall.replace(tzinfo=zone).utcoffset()
    off1 = wall.replace(tzinfo=zone, fold=1).utcoffset()
    assert off0 is not None and off1 is not None
    if off0 == off1:
        return (wall - off0,)
    if off0 > off1:  # fold: the clock went back, the wall time happens twice
        first, last = wall - off0, wall - off1
        return {"first": (first,), "last": (last,), "both": (first, last)}[fold]
    return () if gap == "skip" else (_transition(wall - off1, wall - off0, zone),)


def _policies(schedule: CronSchedule, parsed: _Parsed) -> tuple[str, str]:
    auto_gap, auto_fold = ("skip", "both") if parsed.every_hour else ("shift", "first")
    return schedule.dst_gap or auto_gap, schedule.dst_fold or auto_fold


def _start_wall(after: datetime, zone: ZoneInfo) -> datetime:
    """Wall time to iterate from: back up over the fold if `after` is its first pass, since the
    second pass of earlier wall times is still in the future."""
    local = after.replace(tzinfo=UTC).astimezone(zone)
    off0, off1 = local.utcoffset(), local.replace(fold=1).utcoffset()
    assert off0 is not None and off1 is not None
    back = off0 - off1 if local.fold == 0 and off0 > off1 else timedelta(0)
    return local.replace(tzinfo=None) - back


def _search(schedule: CronSchedule, after: datetime) -> datetime | None:
    """First naive-UTC fire strictly after naive-UTC `after` (whole seconds), within the horizon.

    Taking the first or the last occurrence of each wall time gives two sequences that are each
    non-decreasing, so the answer is the smaller of their first values past `after`."""
    parsed = _parse(schedule.expression)
    zone = parse_timezone(schedule.timezone)
    fast = zone.key in _UTC_KEYS
    gap, fold = _policies(schedule, parsed)
    start = after if fast else _start_wall(after, zone)
    walls = croniter(
        parsed.fields, start, ret_type=datetime,
        second_at_beginning=parsed.seconds, max_years_between_matches=_HORIZON_YEARS,
    )
    first: datetime | None = None
    last: datetime | None = None
    try:
        while first is None or last is None:
            wall = walls.get_next(datetime)
            if wall - start > _HORIZON:
                return None
            images = (wall,) if fast else _images(wall, zone, gap, fold)
            if images and first is None and images[0] > after:
                first = images[0]
            if images and last is None and images[-1] > after:
                last = images[-1]
    except CroniterBadDateError:
        return None
    assert first is not None and last is not None
    return min(first, last)


def _floor_utc(moment: datetime) -> datetime:
    """Naive UTC, floored to the second: fires are whole seconds, so `> after` is unchanged."""
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ValueError("datetime must be timezone-aware")
    return moment.astimezone(UTC).replace(microsecond=0, tzinfo=None)


@lru_cache(maxsize=100_000)
def _next_fire_cached(schedule: CronSchedule, after_epoch_s: int) -> datetime | None:
    found = _search(schedule, _EPOCH + after_epoch_s * _SECOND)
    return None if found is None else found.replace(tzinfo=UTC)


def next_fire(schedule: CronSchedule, after: datetime) -> datetime | None:
    """First fire instant strictly after `after`, aware UTC; None if none within the horizon.

    Cached on (schedule, epoch second) because thousands of jobs share one expression."""
    floored = _floor_utc(after)
    return _next_fire_cached(schedule, (floored - _EPOCH) // _SECOND)


next_fire.cache_info = _next_fire_cached.cache_info  # type: ignore[attr-defined]
next_fire.cache_clear = _next_fire_cached.cache_clear  # type: ignore[attr-defined]


def fire_times(schedule: CronSchedule, start: datetime, end: datetime, limit: int) -> list[datetime]:
    """All fires t with start < t <= end, ascending aware UTC, at most `limit` (uncached: previews
    would only flood the next_fire cache)."""
    result: list[datetime] = []
    cursor, stop = _floor_utc(start), _floor_utc(end)
    while len(result) < limit:
        found = _search(schedule, cursor)
        if found is None or found > stop:
            break
        result.append(found.replace(tzinfo=UTC))
        cursor = found
    return result
