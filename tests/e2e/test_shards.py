"""Two PostgreSQL servers, one fleet: the catalog holds partitions 512-1023, a shard on a second server
0-511. Jobs on each are created through the API, fired by one `chimes scheduler`, run by one
`chimes worker`, and their runs read back through the API (docs/scaling.md, "Shards")."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest

from chimes.ids import partition_of, partition_of_key
from chimes.store import db
from chimes.store.shards import add_shard
from tests.conftest import scratch_database
from tests.e2e.processes import Processes
from tests.e2e.test_crash_safety import soon
from tests.helpers import wait_for
from tests.target import Target

SHARD_RANGE = (0, 511)  # on the second server; 512-1023 stay in the catalog

pytestmark = [pytest.mark.own_shard_map,  # a catalog and one shard of its own, whatever --shards says
              pytest.mark.sharded_pass]  # in the second pass, scripts/test --sharded


@pytest.fixture
async def shard_url(second_server_dsn: str) -> AsyncIterator[str]:
    async with scratch_database(second_server_dsn, "chimes_e2e_shard") as dsn:
        yield dsn


@pytest.fixture
async def database_url(single_database_url: str, shard_url: str) -> str:
    """The catalog, with its map giving SHARD_RANGE to the shard before any role starts."""
    conn = await db.connect(single_database_url)
    try:
        await add_shard(conn, shard_url, *SHARD_RANGE)
    finally:
        await conn.close()
    return single_database_url


def key_in(owner: str, first: int, last: int) -> str:
    """An idempotency key whose jobs the API puts in a partition within first-last."""
    return next(key for key in (f"key-{i}" for i in range(100_000)) if first <= partition_of_key(owner, key) <= last)


async def job_ids_in(url: str) -> set[uuid.UUID]:
    conn = await asyncpg.connect(url)
    try:
        return {r["job_id"] for r in await conn.fetch("SELECT job_id FROM jobs")}
    finally:
        await conn.close()


async def test_jobs_on_two_servers_run_and_show_their_runs(
    processes: Processes, client: httpx.AsyncClient, target: Target, database_url: str, shard_url: str
) -> None:
    processes.scheduler("node-1")
    processes.worker("worker-1")
    jobs = {}
    for side, (first, last) in {"shard": SHARD_RANGE, "catalog": (512, 1023)}.items():
        key = key_in("team-a", first, last)
        body = {"name": side, "schedule": {"at": soon(1.0)}, "task": {"type": "http", "url": f"{target.url}/{side}"}}
        created = await client.post("/jobs", json=body, headers={"Idempotency-Key": key})
        assert created.status_code == 201, created.text
        job_id = uuid.UUID(created.json()["jobId"])
        assert first <= partition_of(job_id) <= last
        again = await client.post("/jobs", json=body, headers={"Idempotency-Key": key})  # a retry: the same job
        assert (again.status_code, again.json()["jobId"]) == (200, str(job_id))
        jobs[side] = job_id
    assert await job_ids_in(shard_url) == {jobs["shard"]}
    assert await job_ids_in(database_url) == {jobs["catalog"]}

    for side in jobs:
        await wait_for(lambda side=side: target.calls_to(f"/{side}"), timeout=30, what=f"the {side} job's call")

    async def finished(job_id: uuid.UUID) -> list[dict[str, object]] | None:
        runs = (await client.get(f"/jobs/{job_id}/runs")).json()["runs"]
        return runs if runs and runs[0]["status"] == "succeeded" else None

    for side, job_id in jobs.items():
        runs = await wait_for(lambda job_id=job_id: finished(job_id), timeout=30, what=f"the {side} run to succeed")
        assert len(runs) == 1
        run = await client.get(f"/runs/{runs[0]['runId']}")
        assert run.status_code == 200 and run.json()["jobId"] == str(job_id), run.text
        assert (await client.get(f"/jobs/{job_id}")).json()["name"] == side
    listed = (await client.get("/jobs")).json()
    assert [j["jobId"] for j in listed["jobs"]] == sorted(str(j) for j in jobs.values())
    assert [c.run_id for c in target.calls] and len(target.calls) == 2

