"""Putting jobs in a Chimes database for a scenario.

Jobs that will fire go in through the real bulk path (``chimes.store.bulk``: validated
``JobSpec``s, COPY into ``jobs`` and ``triggers``). The idle schedules that only make the index big
are generated inside PostgreSQL (``INSERT ... SELECT generate_series``), which is much faster than
sending them; they are due an hour or more later, so no scenario fires them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

from chimes.jobs import JobSpec
from chimes.services.jobs import first_fire
from chimes.store.bulk import copy_rows, job_rows

CHUNK = 5000
IDLE_CHUNK = 500_000

IDLE_JOBS = """
INSERT INTO jobs (job_id, owner, name, cron, timezone, task, retry_policy, timeout_sec, concurrency, priority)
SELECT gen_random_uuid(), 'idle-' || (i % 50), 'idle-' || i, (ARRAY['0 * * * *', '*/5 * * * *', '0 2 * * *',
       '30 6 * * 1-5', '17 */3 * * *'])[1 + i % 5], 'UTC',
       jsonb_build_object('type', 'http', 'method', 'POST', 'url', 'http://127.0.0.1:9/hooks/' || (i % 1000)),
       '{"maxAttempts": 3}', 60, 'skip', 1
FROM generate_series($1::bigint, $2::bigint) AS i
RETURNING job_id
"""
# Spread over the day after the next hour: in the index, between and around every due scan's
# range, but never due during a scenario. Each in its job's partition, as the API puts it: a move of a
# range of partitions (bench/move.py) takes a job's trigger with it.
IDLE_TRIGGERS = """
INSERT INTO triggers (partition_id, fire_at, trigger_id, job_id, job_version, kind)
SELECT chimes_partition_of(j)::smallint,
       date_trunc('second', now() + interval '1 hour' + random() * interval '1 day'), j, j, 1, 0
FROM unnest($1::uuid[]) AS j
"""


def http_job(name: str, schedule: dict[str, Any], url: str, **more: Any) -> JobSpec:
    return JobSpec.model_validate({"name": name, "schedule": schedule,
                                   "task": {"type": "http", "method": "POST", "url": url},
                                   "timeoutSec": 60, **more})


async def add_jobs(pool: asyncpg.Pool, spec: JobSpec, count: int, owner: str = "bench",
                   specs: Callable[[int], JobSpec] | None = None) -> float:
    """COPY ``count`` jobs (``spec``, or ``specs(i)`` for each) in one transaction; returns seconds taken."""
    started = time.perf_counter()
    now = datetime.now(UTC)
    async with pool.acquire() as conn, conn.transaction():
        for first in range(0, count, CHUNK):
            chunk = [spec if specs is None else specs(i) for i in range(first, min(count, first + CHUNK))]
            await copy_rows(conn, job_rows(chunk, owner, now, first_fire))
    return time.perf_counter() - started


async def add_idle_schedules(pool: asyncpg.Pool, count: int, progress: Callable[[str], None]) -> float:
    """``count`` recurring jobs whose triggers are not due for an hour or more; returns seconds taken."""
    started = time.perf_counter()
    async with pool.acquire() as conn:
        for first in range(0, count, IDLE_CHUNK):
            last = min(count, first + IDLE_CHUNK) - 1
            async with conn.transaction():
                ids = [r[0] for r in await conn.fetch(IDLE_JOBS, first, last)]
                await conn.execute(IDLE_TRIGGERS, ids)
            progress(f"idle schedules: {last + 1:,}/{count:,} ({time.perf_counter() - started:.0f}s)")
        await conn.execute("VACUUM ANALYZE jobs")
        await conn.execute("VACUUM ANALYZE triggers")
    return time.perf_counter() - started


def at(instant: datetime) -> dict[str, str]:
    return {"at": instant.isoformat()}


def daily_at(instant: datetime) -> dict[str, str]:
    """A recurring schedule whose next fire is ``instant`` (UTC, whole second): a 6-field cron."""
    return {"cron": f"{instant.second} {instant.minute} {instant.hour} * * *", "timezone": "UTC"}


def due_instant(lead_sec: float) -> datetime:
    """A whole second at least ``lead_sec`` from now, in UTC."""
    return (datetime.now(UTC) + timedelta(seconds=lead_sec + 1)).replace(microsecond=0)
