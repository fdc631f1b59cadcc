"""`chimes shards add` while the fleet runs: a running `chimes scheduler` and `chimes worker` start
serving the new shard within a second or two, with no restart (docs/scaling.md, "Shards")."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import httpx
import pytest

from chimes.ids import partition_of
from tests.conftest import scratch_database
from tests.e2e.processes import Processes
from tests.e2e.test_shards import job_ids_in, key_in
from tests.helpers import wait_for
from tests.target import Target


@pytest.fixture
async def shard_url(second_server_dsn: str) -> AsyncIterator[str]:
    async with scratch_database(second_server_dsn, "chimes_e2e_added_shard") as dsn:
        yield dsn


async def test_a_running_fleet_serves_a_shard_added_meanwhile(
    processes: Processes, client: httpx.AsyncClient, target: Target, database_url: str, shard_url: str
) -> None:
    scheduler = processes.scheduler("node-1")
    worker = processes.worker("worker-1")
    every_second = {"schedule": {"cron": "* * * * * *"}, "concurrency": "allow"}
    before = await client.post("/jobs", json={"name": "before", **every_second,
                                                "task": {"type": "http", "url": f"{target.url}/before"}})
    assert before.status_code == 201, before.text
    await wait_for(lambda: target.calls_to("/before"), timeout=30, what="the catalog's job to run")
    # The catalog's job (its id random) must stay where it is: the shard takes the other half.
    shard_range = (512, 1023) if partition_of(uuid.UUID(before.json()["jobId"])) <= 511 else (0, 511)

    first, last = shard_range
    added = processes.start("shards-add", "shards", "add", shard_url, "--partitions", f"{first}-{last}")
    assert await added.exited(timeout=60) == 0, added.output()

    # The API follows the map within a second: /healthz lists the shard once it has read it. (A create
    # before that makes a random id: in the catalog's half it stays there; in the shard's half the
    # catalog's fence sends it to the shard: tests/integration/test_shard_added_while_running.py.)
    async def api_sees_the_shard() -> bool:
        return "shards" in (await client.get("/healthz")).json()

    await wait_for(api_sees_the_shard, timeout=10, what="the API to read the new map")
    created = await client.post("/jobs", json={"name": "after", **every_second,
                                               "task": {"type": "http", "url": f"{target.url}/after"}},
                                headers={"Idempotency-Key": key_in("team-a", *shard_range)})
    assert created.status_code == 201, created.text
    after = uuid.UUID(created.json()["jobId"])
    assert await job_ids_in(shard_url) == {after}
    # Fired by the node the scheduler started for the new shard, run by the worker's new claim loop.
    await wait_for(lambda: len(target.calls_to("/after")) >= 2, timeout=30, what="the new shard's job to run")
    runs = (await client.get(f"/jobs/{after}/runs")).json()["runs"]
    assert any(r["status"] == "succeeded" for r in runs), runs
    calls_before = len(target.calls_to("/before"))
    await wait_for(lambda: len(target.calls_to("/before")) > calls_before, timeout=30,
                   what="the catalog's job to go on running")
    for process in (scheduler, worker):
        assert "serving a new shard" in process.output(), process.output()[-3000:]
        assert process.proc.poll() is None  # never restarted
