"""The fire times a schedule will really have, as the scheduler computes them: one function for the
API's previews and the dashboard's, so neither can disagree with what fires.

The scheduler fires a recurring job's slot at the slot plus the job's jitter (chimes.slots), and
walks the slots with chimes.schedules (DST policy, interval phase, startAt/endAt, the run cap). A
slot an exclusion calendar excludes is recorded as skipped, not run: previews leave it out. Pure
functions: no clock, no I/O; ``after`` is the caller's.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from pydantic import TypeAdapter

from chimes import schedules
from chimes.calendars import Calendar, excluded_by, resumes_at
from chimes.jobs import AtScheduleSpec, ScheduleSpec
from chimes.slots import jitter_offset

MAX_PREVIEW = 100
MAX_WALKED = 100_000  # slots looked at for one preview: a calendar that excludes nearly every slot ends it
_SCHEDULE = TypeAdapter[Any](ScheduleSpec)
_BEFORE = timedelta(microseconds=1)  # the slots after (resume - this) are those from resume on


def parse_schedule(schedule: Mapping[str, Any]) -> Any:
    """A schedule in its wire form, validated as a job's (raises pydantic.ValidationError)."""
    return _SCHEDULE.validate_python(schedule)


def fires_after(schedule: Any, job_id: uuid.UUID | None, after: datetime, count: int,
                calendars: Sequence[Calendar] = ()) -> list[datetime]:
    """The next ``count`` instants after ``after`` at which the scheduler runs ``schedule`` (a
    validated schedule spec) for the job ``job_id``: slots moved by the job's jitter, less those
    ``calendars`` exclude (all of them, for a calendar that is unusable: exclusions fail closed).
    Without a job (a schedule not saved yet) the jitter is not known, and the slots are given as they
    are. The run cap (``maxRuns``) counts from ``after``."""
    if isinstance(schedule, AtScheduleSpec):
        return [schedule.at] if schedule.at > after and count > 0 else []
    if any(calendar.problem is not None for calendar in calendars):
        return []
    offset = jitter_offset(job_id, schedule.jitter_sec) if job_id is not None else timedelta(0)
    recurrence, cap = schedule.recurrence(), schedule.max_runs
    fires: list[datetime] = []
    slot: datetime | None = after - offset
    for walked in range(1, MAX_WALKED + 1):
        slot = schedules.next_fire(recurrence, slot) if slot is not None else None
        if slot is None or len(fires) >= count or (cap is not None and walked > cap):
            break
        if excluded_by(calendars, slot) is None:
            fires.append(slot + offset)
        elif cap is None:
            # Past what excludes it in one step: the slots a window or a day holds need no walk
            # (with a cap each is walked, as each counts).
            resume = resumes_at(calendars, slot)
            slot = None if resume is None else max(slot, resume - _BEFORE)
    return fires


def upcoming(definition: Mapping[str, Any], job_id: uuid.UUID, next_run_at: datetime | None,
             count: int, slots_fired: int = 0, calendars: Sequence[Calendar] = ()) -> list[datetime]:
    """A saved job's next ``count`` runs, from its pending trigger (``next_run_at``) on; none when it
    has no trigger (paused, ended, or a one-off that ran). ``slots_fired``: the slots counted against
    its maxRuns so far; ``calendars``: those it names in excludeCalendars."""
    schedule = parse_schedule(definition["schedule"])
    if next_run_at is None or count <= 0:
        return []
    if isinstance(schedule, AtScheduleSpec):
        return [next_run_at]
    left = None if schedule.max_runs is None else schedule.max_runs - slots_fired
    if left is not None and left <= 0:
        return []
    # From just before the pending trigger's slot, which it counts among the slots left.
    pending = schedule.model_copy(update={"max_runs": left})
    return fires_after(pending, job_id, next_run_at - timedelta(seconds=1), count, calendars)


def next_run(definition: Mapping[str, Any], job_id: uuid.UUID, next_run_at: datetime | None,
             slots_fired: int = 0, calendars: Sequence[Calendar] = ()) -> datetime | None:
    """A saved job's next run, as its answers give it (``nextRunAt``): its pending trigger's time, or
    for a job that names calendars the first of its upcoming fires that runs (None when its calendars
    exclude every one: an unusable calendar, a window past its last slot). The same walk as the
    preview's, so the two agree."""
    if next_run_at is None or not definition["schedule"].get("excludeCalendars"):
        return next_run_at
    found = upcoming(definition, job_id, next_run_at, 1, slots_fired, calendars)
    return found[0] if found else None
