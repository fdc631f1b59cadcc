"""Loading many jobs at once: the rows of jobs and their first triggers, then COPY, in the caller's
transaction; with shards, the rows of a chunk split by the database that holds each job's partition."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg

from chimes.enums import TriggerKind
from chimes.ids import new_job_ids, partition_of
from chimes.jobs import JobSpec
from chimes.store.jobs import SPEC_COLUMNS, job_columns, spec_values

JOB_COLUMNS = ("job_id", "owner", *SPEC_COLUMNS)
TRIGGER_COLUMNS = ("partition_id", "fire_at", "trigger_id", "job_id", "job_version", "kind")


@dataclass(frozen=True, slots=True)
class Rows:
    """The rows of a chunk of jobs, in the order of JOB_COLUMNS and TRIGGER_COLUMNS. Ids are text
    (PostgreSQL takes either): rows made in another process cross over several times faster so."""

    jobs: list[tuple[Any, ...]]
    triggers: list[tuple[Any, ...]]
    partitions: list[int] = field(default_factory=list)  # of each job, in the order of ``jobs``
    numbers: list[int] = field(default_factory=list)  # the file's line of each job, when read from a file
    calendars: dict[str, int] = field(default_factory=dict)  # the calendars named, each with the first line naming it

    def by_home(self, home_of: Sequence[int], homes: int) -> list[Rows]:
        """The rows split into ``homes`` parts, job ``i`` into part ``home_of[partition]`` (the shard map
        as a list, one entry per partition), each part in the order of these rows."""
        parts = [Rows([], [], [], []) for _ in range(homes)]
        numbered = len(self.numbers) == len(self.jobs)
        for i, (job, partition) in enumerate(zip(self.jobs, self.partitions, strict=True)):
            part = parts[home_of[partition]]
            part.jobs.append(job)
            part.partitions.append(partition)
            if numbered:
                part.numbers.append(self.numbers[i])
        for trigger in self.triggers:
            parts[home_of[trigger[0]]].triggers.append(trigger)
        return parts


#: When a new job fires first (chimes.services.jobs.first_fire): the spec, the job's id, now.
FirstFire = Callable[[JobSpec, uuid.UUID, datetime], datetime | None]


def job_rows(specs: Sequence[JobSpec], owner: str, now: datetime, first_fire: FirstFire,
             id_millis: int | None = None, numbers: Sequence[int] = ()) -> Rows:
    """New jobs for validated specs, each with its first trigger (``first_fire``) where it has one;
    their ids carry ``id_millis`` (default: now), which orders chunks made side by side. ``numbers``:
    the file's line of each spec, kept with its row."""
    jobs, triggers, partitions = [], [], []
    for spec, job_id in zip(specs, new_job_ids(len(specs), id_millis), strict=True):
        text_id = str(job_id)
        partition = partition_of(job_id)
        jobs.append((text_id, owner, *spec_values(job_columns(spec))))
        partitions.append(partition)
        fire_at = first_fire(spec, job_id, now)
        if fire_at is not None:
            triggers.append((partition, fire_at, text_id, text_id, 1, TriggerKind.SCHEDULE.value))
    return Rows(jobs, triggers, partitions, list(numbers))


async def copy_rows(conn: asyncpg.Connection, rows: Rows) -> int:
    """COPY one chunk; the caller holds the transaction, so a failure anywhere in a large import
    leaves nothing behind. Returns how many jobs it wrote."""
    await conn.copy_records_to_table("jobs", records=rows.jobs, columns=JOB_COLUMNS)
    await conn.copy_records_to_table("triggers", records=rows.triggers, columns=TRIGGER_COLUMNS)
    return len(rows.jobs)
