"""Exclusion calendars: which instants a calendar excludes, and what planning a fire records for them."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime

import pytest
from pydantic import ValidationError

from chimes.calendars import Calendar, CalendarSpec, excluded_by
from chimes.enums import TriggerKind
from chimes.scheduler.firing import plan_fire
from chimes.store.scheduling import DueTrigger

JOB = uuid.UUID("0193a0b0-0000-7000-8000-000000000003")
BERLIN_XMAS = Calendar.of("holidays", CalendarSpec(timezone="Europe/Berlin", dates=[date(2026, 12, 25)]))
FREEZE = Calendar.of("freeze", CalendarSpec.model_validate(
    {"windows": [{"start": "2026-12-20T00:00:00Z", "end": "2026-12-21T00:00:00Z"}]}))


def z(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


@pytest.mark.parametrize(("instant", "name"), [
    (z(2026, 12, 24, 22, 59, 59), None),        # 23:59:59 on the 24th in Berlin
    (z(2026, 12, 24, 23, 0), "holidays"),       # 00:00 on the 25th in Berlin
    (z(2026, 12, 25, 22, 59, 59), "holidays"),
    (z(2026, 12, 25, 23, 0), None),
    (z(2026, 12, 20), "freeze"),                # a window's start is in it
    (z(2026, 12, 21), None),                    # its end is not
])
def test_days_are_whole_days_in_the_calendars_zone_and_windows_half_open(instant: datetime, name: str | None) -> None:
    assert excluded_by([BERLIN_XMAS, FREEZE], instant) == name


def test_a_window_must_end_after_it_starts() -> None:
    with pytest.raises(ValidationError, match="end must be after start"):
        CalendarSpec.model_validate({"windows": [{"start": "2026-12-21T00:00:00Z", "end": "2026-12-20T00:00:00Z"}]})


def test_an_excluded_slot_is_recorded_skipped_naming_the_calendar_and_the_schedule_goes_on() -> None:
    trigger = DueTrigger(0, z(2026, 12, 25, 1), JOB, JOB, 1, TriggerKind.SCHEDULE, "0 1 * * *", "UTC",
                         owner="team-a", exclude_calendars=["holidays"])
    fire = plan_fire(trigger, z(2026, 12, 25, 1), calendars={("team-a", "holidays"): BERLIN_XMAS})
    assert [(s.outcome, s.reason) for s in fire.slots] == [("skip", "excluded by calendar holidays")]
    assert fire.next_fire_at == z(2026, 12, 26, 1)
    other_owner = plan_fire(trigger, z(2026, 12, 25, 1), calendars={("team-b", "holidays"): BERLIN_XMAS})
    assert [s.outcome for s in other_owner.slots] == ["run"]
