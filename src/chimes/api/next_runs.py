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


def names_calendars(job: JobRecord) -> bool:
    """Whether the job's schedule excludes calendars (a one-off's never does)."""
    return job.columns.run_at is None and bool(job.columns.exclude_calendars)


async def next_runs(catalog: Pool, jobs: Sequence[JobRecord]) -> dict[uuid.UUID, datetime | None]:
    """Each job's ``nextRunAt``, by job id."""
    naming = [job for job in jobs if names_calendars(job)]
    calendars = await calendars_of_owners(catalog, [job.owner for job in naming]) if naming else {}
    runs = {job.job_id: job.next_run_at for job in jobs}
    for job in naming:
        runs[job.job_id] = previews.next_run(wire.definition(job.columns), job.job_id, job.next_run_at,
                                             job.slots_fired,
                                             named(calendars, job.owner, job.columns.exclude_calendars or []))
    return runs
