"""Exclusion calendars: named sets of days and time windows, in a time zone, that recurring jobs
refer to by name (``schedule.excludeCalendars``). A slot on an excluded day or in an excluded
window is recorded as skipped, with the calendar named in its reason.

Calendars belong to an owner, as jobs do, and live in the catalog database; scheduler nodes keep
them in memory (chimes.scheduler.calendar_book). A calendar a job names that cannot be asked (not
found, or stored in a form that no longer reads) excludes every slot: exclusions fail closed, so a
freeze is never run through by mistake. Pure functions here: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Annotated, Any
from zoneinfo import ZoneInfo

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from chimes import cron
from chimes.ids import EARLIEST_SCHEDULABLE, LATEST_SCHEDULABLE

CALENDAR_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
MAX_DATES = 3660  # ten years of days
MAX_WINDOWS = 1000
# What a calendar may hold: the times a slot can have (chimes.ids), and the days they fall on. Beyond
# them nothing can be excluded, and the ends of Python's and PostgreSQL's times are near: a window at
# year 1 with an offset of +23:59 cannot even be turned into UTC.
EARLIEST_WINDOW, LATEST_WINDOW = EARLIEST_SCHEDULABLE, LATEST_SCHEDULABLE
EARLIEST_DAY, LATEST_DAY = date(1970, 1, 1), date(9998, 12, 31)
_STEP = timedelta(microseconds=1)
NOT_FOUND = "not found"  # the problem of a name its owner has no calendar by


class CalendarWindow(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    start: AwareDatetime
    end: AwareDatetime

    @field_validator("start", "end")
    @classmethod
    def _representable(cls, value: datetime) -> datetime:
        try:
            in_utc = value.astimezone(UTC)
        except OverflowError:
            in_utc = None
        if in_utc is None or not EARLIEST_WINDOW <= in_utc <= LATEST_WINDOW:
            raise ValueError(f"must be from {EARLIEST_WINDOW:%Y-%m-%dT%H:%M:%SZ} to {LATEST_WINDOW:%Y-%m-%dT%H:%M:%SZ}")
        return value

    @model_validator(mode="after")
    def _ordered(self) -> CalendarWindow:
        if self.end <= self.start:
            raise ValueError("end must be after start")
        return self


def _representable_day(value: date) -> date:
    if not EARLIEST_DAY <= value <= LATEST_DAY:
        raise ValueError(f"must be from {EARLIEST_DAY} to {LATEST_DAY}")
    return value


class CalendarSpec(BaseModel):
    """A calendar as users write it: whole days (in ``timezone``) and time windows to exclude."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    timezone: Annotated[str, Field(min_length=1, max_length=64)] = "UTC"
    dates: Annotated[list[Annotated[date, AfterValidator(_representable_day)]], Field(max_length=MAX_DATES)] = \
        Field(default_factory=list)
    windows: Annotated[list[CalendarWindow], Field(max_length=MAX_WINDOWS)] = Field(default_factory=list)

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        cron.parse_timezone(value)
        return value

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


@dataclass(frozen=True, slots=True)
class Calendar:
    """A calendar ready to ask: is this instant excluded? One with a ``problem`` (its name not found,
    or its stored form unreadable) excludes every instant, saying why."""

    name: str
    zone: ZoneInfo
    dates: frozenset[date]
    windows: tuple[tuple[datetime, datetime], ...]
    problem: str | None = None

    @classmethod
    def of(cls, name: str, spec: CalendarSpec) -> Calendar:
        return cls(name, cron.parse_timezone(spec.timezone), frozenset(spec.dates),
                   tuple((w.start.astimezone(UTC), w.end.astimezone(UTC)) for w in spec.windows))

    @classmethod
    def unusable(cls, name: str, problem: str) -> Calendar:
        return cls(name, ZoneInfo("UTC"), frozenset(), (), problem)

    @classmethod
    def stored(cls, name: str, timezone: Any, dates: Any, windows: Any) -> Calendar:
        """The calendar from its stored columns, validated as a write is; one that does not validate
        (written around the API, or by a release with other rules) is unusable. Whatever fails here
        is this calendar's problem: a scheduler node reads every owner's calendars in one go."""
        try:
            return cls.of(name, CalendarSpec(timezone=timezone, dates=dates, windows=windows))
        except Exception as exc:
            return cls.unusable(name, f"cannot be read ({_first_problem(exc)})")

    @property
    def reason(self) -> str:
        """What the record of a slot this calendar excludes says."""
        if self.problem is None:
            return f"excluded by calendar {self.name}"
        return f"not run: calendar {self.name} {self.problem}"

    def excludes(self, instant: datetime) -> bool:
        """Whether ``instant`` falls on an excluded day (in the calendar's zone) or in a window
        (start included, end not)."""
        if self.problem is not None:
            return True
        if instant.astimezone(self.zone).date() in self.dates:
            return True
        return any(start <= instant < end for start, end in self.windows)

    def excluded_until(self, instant: datetime) -> datetime | None:
        """For an instant this calendar excludes, the end of what excludes it: the next midnight in
        its zone, or the latest end of the windows it is in (None for an unusable calendar: never)."""
        if self.problem is not None:
            return None
        until = instant
        local = instant.astimezone(self.zone)
        if local.date() in self.dates:
            following = local.date() + timedelta(days=1)
            until = datetime(following.year, following.month, following.day, tzinfo=self.zone).astimezone(UTC)
        return max([until, *(end for start, end in self.windows if start <= instant < end)])


def _first_problem(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        return f"{where}: {message}" if where else message
    return f"{type(exc).__name__}: {exc}"


def named(calendars: Mapping[tuple[str, str], Calendar], owner: str, names: Sequence[str]) -> list[Calendar]:
    """The owner's calendars by these names, in their order; a name it has none by is an unusable
    calendar, so that what it would have excluded is excluded."""
    return [calendars.get((owner, name)) or Calendar.unusable(name, NOT_FOUND) for name in names]


def first_excluding(calendars: Sequence[Calendar], instant: datetime) -> Calendar | None:
    """The first of ``calendars`` that excludes ``instant``; None when none does."""
    for calendar in calendars:
        if calendar.excludes(instant):
            return calendar
    return None


def excluded_by(calendars: Sequence[Calendar], instant: datetime) -> str | None:
    """The name of the first of ``calendars`` that excludes ``instant``; None when none does."""
    found = first_excluding(calendars, instant)
    return None if found is None else found.name


def resumes_at(calendars: Sequence[Calendar], instant: datetime) -> datetime | None:
    """The first instant from ``instant`` on that none of ``calendars`` excludes (``instant`` itself
    when none does); None when one of them excludes everything from there on."""
    at: datetime | None = instant
    while at is not None and (found := first_excluding(calendars, at)) is not None:
        until = found.excluded_until(at)
        # Each step leaves a day or a window behind, so the walk ends; a zone's odd midnight
        # must not hold it in place.
        at = None if until is None else max(until, at + _STEP)
    return at
