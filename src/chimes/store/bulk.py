"""Loading many jobs at once: COPY into jobs and triggers, in one transaction."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime

import asyncpg

from chimes.ids import new_job_ids, partition_of
from chimes.jobs import JobSpec
from chimes.store.jobs import first_fire, job_columns

JOB_COLUMNS = ("job_id", "owner", "name", "cron", "run_at", "timezone", "jitter_sec", "task", "retry_policy",
               "timeout_sec", "concurrency", "priority", "dst_gap", "dst_fold", "catch_up", "queue_limit", "tags",
               "notify_url", "start_deadline_sec")
TRIGGER_COLUMNS = ("partition_id", "fire_at", "trigger_id", "job_id", "job_version", "kind")


async def copy_jobs(conn: asyncpg.Connection, owner: str, specs: Sequence[JobSpec], now: datetime) -> list[uuid.UUID]:
    """COPY a chunk of validated jobs and their first triggers. The caller holds the transaction,
    so a failure anywhere in a large import leaves nothing behind."""
    jobs, triggers, ids = [], [], new_job_ids(len(specs))
    for spec, job_id in zip(specs, ids, strict=True):
        jobs.append((job_id, owner, *job_columns(spec)))
        fire_at = first_fire(spec, job_id, now)
        if fire_at is not None:
            triggers.append((partition_of(job_id), fire_at, job_id, job_id, 1, 0))
    await conn.copy_records_to_table("jobs", records=jobs, columns=JOB_COLUMNS)
    await conn.copy_records_to_table("triggers", records=triggers, columns=TRIGGER_COLUMNS)
    return ids
