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

pytestmark = [pytest.mark.own_shard_map,  # databases and a shard map of its own, whatever --shards says
              pytest.mark.sharded_pass]  # in the second pass, scripts/test --sharded


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

    async def a_run_succeeded() -> bool:  # two calls may come from one fire, their outcomes still in flight
        runs = (await client.get(f"/jobs/{after}/runs")).json()["runs"]
        return any(r["status"] == "succeeded" for r in runs)

    await wait_for(a_run_succeeded, timeout=10, what="an outcome of the new shard's job to be recorded")
    calls_before = len(target.calls_to("/before"))
    await wait_for(lambda: len(target.calls_to("/before")) > calls_before, timeout=30,
                   what="the catalog's job to go on running")
    for process in (scheduler, worker):
        assert "serving a new shard" in process.output(), process.output()[-3000:]
        assert process.proc.poll() is None  # never restarted


async def test_a_cap_holds_across_a_shard_added_while_the_worker_runs(
    processes: Processes, client: httpx.AsyncClient, target: Target, database_url: str, shard_url: str
) -> None:
    capped = processes.start("cap-set", "cap", "set", "owner:team-a", "1")
    assert await capped.exited(timeout=60) == 0, capped.output()
    worker = processes.worker("worker-1", concurrency=10)  # started with one database: caps counted there
    await wait_for(lambda: "worker worker-1 starting" in worker.output(), timeout=30, what="the worker to start")
    first = await client.post("/jobs", json={"name": "first", "schedule": {"cron": "0 0 1 1 *"},
                                             "task": {"type": "http", "url": f"{target.url}/capped"}})
    assert first.status_code == 201, first.text
    first_id = uuid.UUID(first.json()["jobId"])
    low, high = (512, 1023) if partition_of(first_id) <= 511 else (0, 511)  # the shard takes the other half
    added = processes.start("shards-add", "shards", "add", shard_url, "--partitions", f"{low}-{high}")
    assert await added.exited(timeout=60) == 0, added.output()
    await wait_for(lambda: "serving a new shard" in worker.output(), timeout=20, what="the worker to serve it")

    async def api_sees_the_shard() -> bool:
        return "shards" in (await client.get("/healthz")).json()

    await wait_for(api_sees_the_shard, timeout=10, what="the API to read the new map")
    second = await client.post("/jobs", json={"name": "second", "schedule": {"cron": "0 0 1 1 *"},
                                              "task": {"type": "http", "url": f"{target.url}/capped"}},
                               headers={"Idempotency-Key": key_in("team-a", low, high)})
    assert second.status_code == 201, second.text
    assert await job_ids_in(shard_url) == {uuid.UUID(second.json()["jobId"])}
    target.delays["/capped"] = lambda n: 0.4
    for job in (first, second):
        for _ in range(3):
            started = await client.post(f"/jobs/{job.json()['jobId']}/runs")
            assert started.status_code == 202, started.text
    await wait_for(lambda: len(target.calls_to("/capped")) == 6, timeout=60, what="every run, one at a time")
    # One at a time across both databases: the catalog's claim loop, started before the shard was
    # added, takes its runs' slots in the catalog as the new shard's does.
    assert target.most_in_flight["/capped"] == 1
