"""``nextRunAt`` in the answers that show jobs: the next slot that will run. For a job that names
exclusion calendars that is not always its pending trigger (which may be a slot a calendar excludes,
to be recorded as skipped), so it is walked past the excluded slots as the preview is
(chimes.previews.next_run), with the calendars read from the catalog once per answer."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime

from chimes import previews, wire
from chimes.calendars import named
from chimes.store.calendars import calendars_of_owners
from chimes.store.db import Pool
from chimes.store.jobs import JobRecord


def names_calendars(definition: dict[str, object]) -> bool:
    schedule = definition["schedule"]
    return isinstance(schedule, dict) and bool(schedule.get("excludeCalendars"))


async def next_runs(catalog: Pool, jobs: Sequence[JobRecord]) -> dict[uuid.UUID, datetime | None]:
    """Each job's ``nextRunAt``, by job id."""
    definitions = {job.job_id: wire.definition(job.columns) for job in jobs}
    naming = [job for job in jobs if names_calendars(definitions[job.job_id])]
    calendars = await calendars_of_owners(catalog, [job.owner for job in naming]) if naming else {}
    runs = {job.job_id: job.next_run_at for job in jobs}
    for job in naming:
        definition = definitions[job.job_id]
        names = definition["schedule"]["excludeCalendars"]
        runs[job.job_id] = previews.next_run(definition, job.job_id, job.next_run_at, job.slots_fired,
                                             named(calendars, job.owner, names))
    return runs
