"""Exclusion calendars: which instants a calendar excludes, and what planning a fire records for them."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime

import pytest
from pydantic import ValidationError

from chimes import previews
from chimes.calendars import Calendar, CalendarSpec, excluded_by
from chimes.enums import TriggerKind
from chimes.scheduler.firing import plan_fire
from chimes.slots import jitter_offset
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
    trigger = DueTrigger(partition_id=0, fire_at=z(2026, 12, 25, 1), trigger_id=JOB, job_id=JOB, job_version=1,
                         kind=TriggerKind.SCHEDULE, cron="0 1 * * *", timezone="UTC",
                         owner="team-a", exclude_calendars=["holidays"])
    fire = plan_fire(trigger, z(2026, 12, 25, 1), calendars={("team-a", "holidays"): BERLIN_XMAS})
    assert [(s.outcome, s.reason) for s in fire.slots] == [("skip", "excluded by calendar holidays")]
    assert fire.next_fire_at == z(2026, 12, 26, 1)



# --- exclusions fail closed --------------------------------------------------------------------

POISON = {"timezone": "UTC", "dates": [],
          "windows": [{"start": "0001-01-01T00:00:00+23:59", "end": "0001-01-02T00:00:00Z"}]}


def test_a_calendar_is_refused_beyond_the_times_every_zone_can_represent() -> None:
    """A window at year 1 with an offset of +23:59 cannot even be turned into UTC: it is refused,
    naming the field, as are days and windows past the times a slot can have."""
    for body, where in [(POISON, ("windows", 0, "start")),
                        ({"windows": [{"start": "2026-01-01T00:00:00Z", "end": "9999-12-31T23:59:59-23:59"}]},
                         ("windows", 0, "end")),
                        ({"windows": [{"start": "1969-12-31T23:59:59Z", "end": "2026-01-01T00:00:00Z"}]},
                         ("windows", 0, "start")),
                        ({"dates": ["2026-12-25", "9999-12-31"]}, ("dates", 1)),
                        ({"dates": ["1969-12-31"]}, ("dates", 0))]:
        with pytest.raises(ValidationError) as refused:
            CalendarSpec.model_validate(body)
        assert refused.value.errors()[0]["loc"] == where
    widest = CalendarSpec.model_validate({"dates": ["1970-01-01", "9998-12-31"], "timezone": "Pacific/Kiritimati",
                                          "windows": [{"start": "1970-01-01T00:00:00Z",
                                                       "end": "9999-01-01T00:00:00Z"}]})
    calendar = Calendar.of("widest", widest)
    assert calendar.excludes(z(1970, 1, 1)) and calendar.excludes(z(9998, 12, 31, 23, 59, 59))


def test_a_stored_calendar_that_does_not_parse_is_unusable_and_excludes_every_slot() -> None:
    unusable = Calendar.stored("poison", POISON["timezone"], POISON["dates"], POISON["windows"])
    assert unusable.problem is not None and unusable.problem.startswith("cannot be read (windows.0.start: must be")
    assert unusable.excludes(z(2026, 1, 1)) and unusable.reason.startswith("not run: calendar poison cannot be read")
    for timezone, dates, windows in [("Mars/Base", [], []), ("UTC", [None], []), ("UTC", ["10000-01-01"], []),
                                     ("UTC", [], "not a list"), ("UTC", [], [{"start": 12345678901234567890}])]:
        assert Calendar.stored("bad", timezone, dates, windows).problem is not None
    fine = Calendar.stored("fine", "Europe/Berlin", ["2026-12-25"], [])
    assert fine.problem is None and fine.excludes(z(2026, 12, 24, 23)) and not fine.excludes(z(2026, 12, 24, 22))


def test_a_calendar_the_owner_does_not_have_or_cannot_be_read_skips_every_slot_naming_it() -> None:
    """Fail closed: a name not found (another owner's calendar of that name does not count), an
    unusable calendar, or no calendars read at all: the slot is recorded as skipped, saying why."""
    trigger = DueTrigger(partition_id=0, fire_at=z(2026, 12, 27, 1), trigger_id=JOB, job_id=JOB, job_version=1,
                         kind=TriggerKind.SCHEDULE, cron="0 1 * * *", timezone="UTC",
                         owner="team-a", exclude_calendars=["holidays"])
    cases = [({("team-b", "holidays"): BERLIN_XMAS}, "not run: calendar holidays not found"),
             ({("team-a", "holidays"): Calendar.stored("holidays", "UTC", [], "[")},
              "not run: calendar holidays cannot be read"),
             (None, "not run: calendar holidays not read yet")]
    for calendars, reason in cases:
        fire = plan_fire(trigger, z(2026, 12, 27, 1), calendars=calendars)
        assert [s.outcome for s in fire.slots] == ["skip"] and fire.slots[0].reason.startswith(reason)
        assert fire.next_fire_at == z(2026, 12, 28, 1)  # the schedule goes on
    ran = plan_fire(trigger, z(2026, 12, 27, 1), calendars={("team-a", "holidays"): BERLIN_XMAS})
    assert [s.outcome for s in ran.slots] == ["run"]


# --- previews and nextRunAt ----------------------------------------------------------------------

def test_the_next_run_is_the_first_slot_no_calendar_excludes_as_the_preview_says() -> None:
    definition = {"schedule": {"cron": "0 1 * * *", "excludeCalendars": ["holidays", "freeze"]}}
    calendars = [BERLIN_XMAS, Calendar.of("freeze", CalendarSpec.model_validate(
        {"windows": [{"start": "2026-12-26T00:00:00Z", "end": "2026-12-28T00:00:00Z"}]}))]
    pending = z(2026, 12, 25, 1)  # the trigger waits on an excluded slot: it will be recorded as skipped
    assert previews.next_run(definition, JOB, pending, 0, calendars) == z(2026, 12, 28, 1)
    assert previews.upcoming(definition, JOB, pending, 2, 0, calendars) == [z(2026, 12, 28, 1), z(2026, 12, 29, 1)]
    assert previews.next_run({"schedule": {"cron": "0 1 * * *"}}, JOB, pending) == pending
    unusable = [Calendar.unusable("holidays", "not found")]
    assert previews.next_run(definition, JOB, pending, 0, unusable) is None
    assert previews.upcoming(definition, JOB, pending, 3, 0, unusable) == []


@pytest.mark.parametrize("schedule", [{"cron": "* * * * * *"}, {"everySec": 7, "jitterSec": 3},
                                      {"cron": "30 * * * *", "timezone": "Europe/Berlin"},
                                      {"cron": "0 0 * * *", "timezone": "America/Santiago"}])
def test_stepping_past_an_exclusion_finds_the_slots_walking_slot_by_slot_finds(schedule: dict[str, object]) -> None:
    """Without a run cap a preview steps over a day or a window at once; with one it walks each
    slot (each counts): both give the same fires."""
    calendars = [Calendar.of("days", CalendarSpec(timezone="America/Santiago",
                                                  dates=[date(2026, 9, 6), date(2026, 9, 7), date(2026, 9, 9)])),
                 Calendar.of("windows", CalendarSpec.model_validate({"windows": [
                     {"start": "2026-09-05T22:00:00Z", "end": "2026-09-06T01:30:00Z"},
                     {"start": "2026-09-07T23:59:59Z", "end": "2026-09-08T00:00:01Z"},
                     {"start": "2026-09-08T12:00:00Z", "end": "2026-09-08T23:00:00Z"}]}))]
    after = z(2026, 9, 5, 23, 59, 58)
    stepped = previews.fires_after(previews.parse_schedule(schedule), JOB, after, 12, calendars)
    walked = previews.fires_after(previews.parse_schedule({**schedule, "maxRuns": 10**9}), JOB, after, 12, calendars)
    assert stepped == walked and len(stepped) == 12
    offset = jitter_offset(JOB, int(str(schedule.get("jitterSec", 0))))  # the calendars ask the slot, not the fire
    assert all(excluded_by(calendars, fire - offset) is None for fire in stepped)
