"""The fire times a schedule will really have, as the scheduler computes them: one function for the
API's previews and the dashboard's, so neither can disagree with what fires.

The scheduler fires a recurring job's slot at the slot plus the job's jitter (chimes.slots), and
walks the slots with chimes.schedules (DST policy, interval phase, startAt/endAt). Pure functions:
no clock, no I/O; ``after`` is the caller's.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from pydantic import TypeAdapter

from chimes import schedules
from chimes.jobs import AtScheduleSpec, ScheduleSpec
from chimes.slots import jitter_offset

MAX_PREVIEW = 100
# Far enough for a yearly schedule's preview of MAX_PREVIEW fires, near enough to end a walk of a
# schedule whose remaining fires are rarer than that.
_HORIZON = timedelta(days=366 * 100)
_SCHEDULE = TypeAdapter[Any](ScheduleSpec)


def parse_schedule(schedule: Mapping[str, Any]) -> Any:
    """A schedule in its wire form, validated as a job's (raises pydantic.ValidationError)."""
    return _SCHEDULE.validate_python(schedule)


def fires_after(schedule: Any, job_id: uuid.UUID | None, after: datetime, count: int) -> list[datetime]:
    """The next ``count`` instants after ``after`` at which the scheduler fires ``schedule`` (a
    validated schedule spec) for the job ``job_id``: slots moved by the job's jitter. Without a job
    (a schedule not saved yet) the jitter is not known, and the slots are given as they are."""
    if isinstance(schedule, AtScheduleSpec):
        return [schedule.at] if schedule.at > after and count > 0 else []
    if schedule.max_runs is not None:
        count = min(count, schedule.max_runs)
    offset = jitter_offset(job_id, schedule.jitter_sec) if job_id is not None else timedelta(0)
    nominal_after = after - offset
    slots = schedules.fire_times(schedule.recurrence(), nominal_after, nominal_after + _HORIZON, count)
    return [slot + offset for slot in slots]


def upcoming(definition: Mapping[str, Any], job_id: uuid.UUID, next_run_at: datetime | None,
             count: int, slots_fired: int = 0) -> list[datetime]:
    """A saved job's next ``count`` fires, from its pending trigger (``next_run_at``) on; none when
    it has no trigger (paused, ended, or a one-off that ran). ``slots_fired``: the slots counted
    against its maxRuns so far."""
    schedule = parse_schedule(definition["schedule"])
    if not isinstance(schedule, AtScheduleSpec) and schedule.max_runs is not None:
        count = min(count, schedule.max_runs - slots_fired)
    if next_run_at is None or count <= 0:
        return []
    if isinstance(schedule, AtScheduleSpec):
        return [next_run_at]
    # The cap is counted here, from the pending trigger: the rest of the schedule has no cap of its own.
    uncapped = schedule.model_copy(update={"max_runs": None})
    return [next_run_at, *fires_after(uncapped, job_id, next_run_at, count - 1)]
