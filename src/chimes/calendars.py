"""Exclusion calendars: named sets of days and time windows, in a time zone, that recurring jobs
refer to by name (``schedule.excludeCalendars``). A slot on an excluded day or in an excluded
window is recorded as skipped, with the calendar named in its reason.

Calendars belong to an owner, as jobs do, and live in the catalog database; scheduler nodes keep
them in memory (chimes.scheduler.calendar_book). Pure functions here: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Annotated, Any
from zoneinfo import ZoneInfo

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator, model_validator

from chimes import cron

CALENDAR_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
MAX_DATES = 3660  # ten years of days
MAX_WINDOWS = 1000


class CalendarWindow(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    start: AwareDatetime
    end: AwareDatetime

    @model_validator(mode="after")
    def _ordered(self) -> CalendarWindow:
        if self.end <= self.start:
            raise ValueError("end must be after start")
        return self


class CalendarSpec(BaseModel):
    """A calendar as users write it: whole days (in ``timezone``) and time windows to exclude."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    timezone: Annotated[str, Field(min_length=1, max_length=64)] = "UTC"
    dates: Annotated[list[date], Field(max_length=MAX_DATES)] = Field(default_factory=list)
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
    """A calendar ready to ask: is this instant excluded?"""

    name: str
    zone: ZoneInfo
    dates: frozenset[date]
    windows: tuple[tuple[datetime, datetime], ...]

    @classmethod
    def of(cls, name: str, spec: CalendarSpec) -> Calendar:
        return cls(name, cron.parse_timezone(spec.timezone), frozenset(spec.dates),
                   tuple((w.start.astimezone(UTC), w.end.astimezone(UTC)) for w in spec.windows))

    def excludes(self, instant: datetime) -> bool:
        """Whether ``instant`` falls on an excluded day (in the calendar's zone) or in a window
        (start included, end not)."""
        if instant.astimezone(self.zone).date() in self.dates:
            return True
        return any(start <= instant < end for start, end in self.windows)


def excluded_by(calendars: Sequence[Calendar], instant: datetime) -> str | None:
    """The name of the first of ``calendars`` that excludes ``instant``; None when none does."""
    for calendar in calendars:
        if calendar.excludes(instant):
            return calendar.name
    return None
