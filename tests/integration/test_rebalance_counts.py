"""The counts `chimes shards rebalance` plans by (chimes.store.rebalance.read_counts), read on a real
database: jobs per partition, and triggers due within the hour per partition."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import httpx
import pytest

from chimes.ids import partition_of
from chimes.store.rebalance import read_counts
from chimes.store.shards import ShardMap, ShardMapError, ShardRange

pytestmark = pytest.mark.own_shard_map  # it builds the maps it reads by, whatever --shards says


async def create(client: httpx.AsyncClient, name: str, cron: str) -> uuid.UUID:
    body = {"name": name, "schedule": {"cron": cron}, "task": {"type": "http", "url": "http://127.0.0.1:9/"}}
    created = await client.post("/jobs", json=body)
    assert created.status_code == 201, created.text
    return uuid.UUID(created.json()["jobId"])


def tally(job_ids: list[uuid.UUID]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for job_id in job_ids:
        counts[partition_of(job_id)] = counts.get(partition_of(job_id), 0) + 1
    return counts


async def test_jobs_and_triggers_due_within_the_hour_are_counted_per_partition(
    client: httpx.AsyncClient, database_url: str
) -> None:
    far_hour = (datetime.now(UTC).hour + 12) % 24  # 11 to 12 hours away: never due within the hour
    soon = [await create(client, f"every-minute-{n}", "* * * * *") for n in range(12)]
    later = [await create(client, f"twice-a-day-{n}", f"0 {far_hour} * * *") for n in range(12)]
    catalog_only = ShardMap(0, ())
    assert await read_counts(database_url, catalog_only, "jobs") == tally(soon + later)
    assert await read_counts(database_url, catalog_only, "due") == tally(soon)
    # Both homes of this map are one database, which holds every job: each home counts only the
    # partitions it holds (rows of other partitions are another home's), so no job counts twice.
    half = ShardMap(1, (ShardRange(512, 1023, 1, database_url, 1),))
    assert await read_counts(database_url, half, "jobs") == tally(soon + later)
    with pytest.raises(ShardMapError, match="--by 'runs'"):
        await read_counts(database_url, catalog_only, "runs")
