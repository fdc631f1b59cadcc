"""Cron expressions in IANA time zones, resolved to UTC fire instants.

Pure functions: no I/O and no clock reads, so callers (scheduler, API validation) pass ``after``.

Dialect: Debian cron (docs/semantics.md, "Cron expressions"). 5 fields (minute hour day-of-month
month day-of-week), 6 fields with the *seconds first*, or one of the macros @yearly @annually
@monthly @weekly @daily @midnight @hourly. Fields take numbers, month and day names (any case),
lists, ranges (``5-5`` is just 5), steps (``*/n``, ``a-b/n``). Day matching follows Debian: when the day-of-month or the
day-of-week field begins with ``*`` (``*/10`` included) a day must match both, otherwise either
(``0 2 */10 * 5`` runs on days 1, 11, 21 and 31 that are Fridays). Extensions kept from earlier
releases: ``L``, ``LW``, ``nW``, ``a-L`` in day-of-month; ``d#n``, ``dL`` and ``Ld`` in day-of-week;
``?`` as ``*`` in the day fields; ranges that wrap around (``22-2`` in hours; in day-of-week round the
seven days once, so ``5-1/2`` is Friday and Sunday); ``a/n`` = ``a-MAX/n`` (``1/2`` in day-of-week is
1,3,5,7, Sunday included), which Debian refuses.
Hashed/random fields (``H``, ``R``) are rejected: a schedule must be deterministic to be cached.

DST semantics (following Vixie/Debian cron). Fields are matched against naive wall-clock times in
the job's zone; each wall time is mapped to UTC here with an explicit policy:

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

Search horizon: calendars repeat every 400 years (146,097 days, a whole number of weeks) and zones
follow a yearly standing rule after the last transition their tables list, so an expression that
fires at all after ``_REFERENCE`` fires within 400 years of any instant; validation checks exactly
that, without reading the clock.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from calendar import monthrange
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import NamedTuple
from zoneinfo import ZoneInfo, available_timezones

# Late enough that every zone follows its standing yearly rule (the tz tables list explicit
# transitions to 2087 at most), so a fire after it recurs in every later 400-year cycle.
_REFERENCE = datetime(2100, 1, 1)
_CYCLE_YEARS = 400  # Gregorian calendar cycle: dates and weekdays repeat exactly
_LAST_YEAR = 9999  # datetime's limit
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
_BOUNDS = {"second": (0, 59), "minute": (0, 59), "hour": (0, 23), "day-of-month": (1, 31),
           "month": (1, 12), "day-of-week": (0, 7)}
_NAMES = {
    "month": {name: number for number, name in enumerate(
        ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"), start=1)},
    "day-of-week": {name: number for number, name in enumerate(("sun", "mon", "tue", "wed", "thu", "fri", "sat"))},
}
_FIELDS = {5: tuple(_RANGES)[1:], 6: tuple(_RANGES)}
_MONTH_LENGTHS = {2: (28, 29), 4: (30,), 6: (30,), 9: (30,), 11: (30,)}  # others: (31,)
_NONDETERMINISTIC = re.compile(r"(?<![a-z])[hr](?![a-z])")
_DIGITS = re.compile(r"[0-9]+")
_NEAREST_WEEKDAY = re.compile(r"([0-9]+)w")
_NTH_WEEKDAY = re.compile(r"([a-z0-9]+)#([0-9]+)")
_LAST_WEEKDAY_OF = re.compile(r"l([a-z0-9]+)|([a-z0-9]+)l")
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


class _Days(NamedTuple):
    """Which days of a month match; hashable, so month shapes can be cached per expression."""

    dom: frozenset[int]  # plain days of month
    last_day: bool  # L
    last_weekday: bool  # LW: the last Monday-to-Friday of the month
    nearest_weekday: frozenset[int]  # nW: the Monday-to-Friday nearest to day n, within the month
    dow: frozenset[int]  # 0 = Sunday .. 6
    nth: frozenset[tuple[int, int]]  # d#n: (weekday, n)
    last_of: frozenset[int]  # dL / Ld: the last such weekday of the month
    both: bool  # Debian: a day field beginning with '*' makes the two fields AND, else OR


class _Parsed(NamedTuple):
    seconds: tuple[int, ...]  # ascending; (0,) for 5-field expressions
    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    months: frozenset[int]
    days: _Days
    every_hour: bool  # hour field covers all 24 hours -> elapsed-time DST defaults
    some_day_matches: bool  # False: the day and month fields never meet (0 0 30 2 *)


class _BadField(Exception):
    pass


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


def _number(name: str, token: str) -> int:
    low, high = _BOUNDS[name]
    named = _NAMES.get(name, {}).get(token)
    if named is not None:
        return named
    if not _DIGITS.fullmatch(token) or not low <= int(token) <= high:
        raise _BadField
    return int(token)


def _stepped(name: str, term: str) -> list[int]:
    """Values of `*`, `a`, `a-b`, each optionally `/n`; `a/n` runs to the field's maximum, and
    a range whose end is below its start wraps around (as croniter read it)."""
    low, high = _BOUNDS[name]
    base, slash, step_text = term.partition("/")
    step = 1
    if slash:
        if not _DIGITS.fullmatch(step_text) or int(step_text) == 0:
            raise _BadField
        step = int(step_text)
    if base == "*" or (base == "?" and name in ("day-of-month", "day-of-week")):
        start, end = low, high
    elif "-" in base:
        first, _, last = base.partition("-")
        start = _number(name, first)
        end = high if name == "day-of-month" and last == "l" else _number(name, last)
    else:
        start = _number(name, base)
        end = high if slash else start
    if start > end and name == "day-of-week":
        # 7 and 0 are both Sunday: a range that wraps goes round the seven days once, so that
        # 5-1/2 is Friday and Sunday, not Friday, Sunday (7) and Monday; 7-2 is Sunday to Tuesday.
        high = 6
        if start == 7:
            start = 0
    if start <= end:
        return list(range(start, end + 1, step))
    return [*range(start, high + 1), *range(low, end + 1)][::step]


def _plain_field(name: str, text: str) -> frozenset[int]:
    values: set[int] = set()
    for term in text.split(","):
        values.update(_stepped(name, term))
    return frozenset(values)


def _day_fields(dom_text: str, dow_text: str) -> _Days:
    dom: set[int] = set()
    nearest: set[int] = set()
    last_day = last_weekday = False
    for term in dom_text.split(","):
        weekday_term = _NEAREST_WEEKDAY.fullmatch(term)
        if term == "l":
            last_day = True
        elif term == "lw":
            last_weekday = True
        elif weekday_term:
            nearest.add(_number("day-of-month", weekday_term[1]))
        else:
            dom.update(_stepped("day-of-month", term))
    dow: set[int] = set()
    nth: set[tuple[int, int]] = set()
    last_of: set[int] = set()
    for term in dow_text.split(","):
        nth_term, last_term = _NTH_WEEKDAY.fullmatch(term), _LAST_WEEKDAY_OF.fullmatch(term)
        if nth_term:
            if not _DIGITS.fullmatch(nth_term[2]) or not 1 <= int(nth_term[2]) <= 5:
                raise _BadField
            nth.add((_number("day-of-week", nth_term[1]) % 7, int(nth_term[2])))
        elif last_term and term not in _NAMES["day-of-week"]:
            last_of.add(_number("day-of-week", last_term[1] or last_term[2]) % 7)
        else:
            dow.update(value % 7 for value in _stepped("day-of-week", term))
    both = dom_text[0] in "*?" or dow_text[0] in "*?"
    return _Days(frozenset(dom), last_day, last_weekday, frozenset(nearest), frozenset(dow), frozenset(nth),
                 frozenset(last_of), both)


def _field_error(expression: str, name: str, field: str) -> CronError:
    return CronError(f"invalid cron expression {expression!r}: bad {name} field {field!r}"
                     f" (expected {_RANGES[name]}, lists, ranges, steps)")


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
    names = _FIELDS[len(fields)]
    plain: dict[str, frozenset[int]] = {"second": frozenset({0})}
    for name, field in zip(names, fields, strict=True):
        try:
            if name not in ("day-of-month", "day-of-week"):
                plain[name] = _plain_field(name, field.lower())
        except _BadField:
            raise _field_error(expression, name, field) from None
    dom_text, dow_text = fields[-3].lower(), fields[-1].lower()
    try:
        _day_fields(dom_text, "*")
    except _BadField:
        raise _field_error(expression, "day-of-month", fields[-3]) from None
    try:
        days = _day_fields(dom_text, dow_text)
    except _BadField:
        raise _field_error(expression, "day-of-week", fields[-1]) from None
    hours = tuple(sorted(plain["hour"]))
    return _Parsed(tuple(sorted(plain["second"])), tuple(sorted(plain["minute"])), hours, plain["month"], days,
                   len(hours) == 24, _some_day_matches(days, plain["month"]))


@lru_cache(maxsize=65536)
def _month_days(days: _Days, length: int, first_weekday: int) -> tuple[int, ...]:
    """Matching days of a month with `length` days whose 1st is `first_weekday` (0 = Sunday):
    nothing else about a month matters, so there are only 28 shapes per expression."""
    last_weekday = length - {0: 2, 6: 1}.get((first_weekday + length - 1) % 7, 0)
    nearest: set[int] = set()
    for target in days.nearest_weekday:
        day = min(target, length)  # 31W in a 30-day month: nearest to the 30th, as croniter had it
        weekday = (first_weekday + day - 1) % 7
        if weekday == 6:
            day = day - 1 if day > 1 else day + 2
        elif weekday == 0:
            day = day + 1 if day < length else day - 2
        nearest.add(day)
    matching = []
    for day in range(1, length + 1):
        weekday = (first_weekday + day - 1) % 7
        by_date = (day in days.dom or day in nearest or (days.last_day and day == length)
                   or (days.last_weekday and day == last_weekday))
        by_weekday = (weekday in days.dow or (weekday, (day + 6) // 7) in days.nth
                      or (weekday in days.last_of and day + 7 > length))
        if (by_date and by_weekday) if days.both else (by_date or by_weekday):
            matching.append(day)
    return tuple(matching)


def _some_day_matches(days: _Days, months: frozenset[int]) -> bool:
    """Whether any date ever matches: every month length meets every weekday of its 1st within
    one 400-year cycle, so trying each shape is exact."""
    return any(_month_days(days, length, weekday)
               for month in months for length in _MONTH_LENGTHS.get(month, (31,)) for weekday in range(7))


def _times_after(parsed: _Parsed, hour: int, minute: int, second: int) -> Iterator[tuple[int, int, int]]:
    """Matching times of day strictly after hour:minute:second, ascending."""
    for h in parsed.hours[bisect_left(parsed.hours, hour):]:
        for m in parsed.minutes[bisect_left(parsed.minutes, minute) if h == hour else 0:]:
            exact = h == hour and m == minute
            for s in parsed.seconds[bisect_right(parsed.seconds, second) if exact else 0:]:
                yield h, m, s


def _walls(parsed: _Parsed, start: datetime) -> Iterator[datetime]:
    """Naive wall times matching the expression, strictly after naive `start`, ascending, up to
    one calendar cycle past the later of `start` and _REFERENCE (docstring: search horizon)."""
    last_year = min(_LAST_YEAR, max(start.year, _REFERENCE.year) + _CYCLE_YEARS)
    year, month, first_day = start.year, start.month, start.day
    while year <= last_year:
        if month in parsed.months:
            weekday, length = monthrange(year, month)
            candidates = _month_days(parsed.days, length, (weekday + 1) % 7)
            for day in candidates[bisect_left(candidates, first_day):]:
                if day == start.day and (year, month) == (start.year, start.month):
                    times: Iterator[tuple[int, int, int]] = _times_after(
                        parsed, start.hour, start.minute, start.second)
                else:
                    times = _times_after(parsed, -1, -1, -1)
                for h, m, s in times:
                    yield datetime(year, month, day, h, m, s)
        first_day = 1
        month += 1
        if month == 13:
            year, month = year + 1, 1


def validate_cron(
    expression: str, timezone: str = "UTC", *, dst_gap: str | None = None, dst_fold: str | None = None
) -> CronSchedule:
    """Validate user input up front, so that a stored schedule has a next fire from any instant."""
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
    if not parsed.some_day_matches:
        return None
    zone = parse_timezone(schedule.timezone)
    if zone.key in _UTC_KEYS:
        return next(_walls(parsed, after), None)
    gap, fold = _policies(schedule, parsed)
    first: datetime | None = None
    last: datetime | None = None
    for wall in _walls(parsed, _start_wall(after, zone)):
        images = _images(wall, zone, gap, fold)
        if images and first is None and images[0] > after:
            first = images[0]
        if images and last is None and images[-1] > after:
            last = images[-1]
        if first is not None and last is not None:
            return min(first, last)
    return None


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
    """First fire instant strictly after `after`, aware UTC; None if it never fires (validation
    refuses such schedules).

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
