"""Owner and tag caps across shards: exact, by slots in the catalog (docs/scaling.md, "Caps and quotas
across shards").

Three homes: shard A (partitions 0-339, a database of the test server), shard B (340-679, on a
server of its own) and the catalog (680-1023). Real `chimes worker` processes claim from all three;
the target on 127.0.0.1 counts the calls it is answering at once."""

from __future__ import annotations

import asyncio
import itertools
import signal
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import asyncpg
import httpx
import pytest
from click.testing import CliRunner

from chimes.cli.main import cli
from chimes.ids import partition_of, partition_of_key
from chimes.store import db
from chimes.store.cap_slots import CapSlots
from chimes.worker.worker import Worker
from tests.conftest import scratch_database
from tests.e2e.processes import Processes
from tests.helpers import add_shards, auth_as, wait_for
from tests.integration.fleet import FAST_WORKER
from tests.target import Target

# own_shard_map: databases and a shard map of its own, whatever --shards says
pytestmark = [pytest.mark.own_shard_map, pytest.mark.long]

HOMES = {"a": (0, 339), "b": (340, 679), "catalog": (680, 1023)}


@pytest.fixture
async def shard_a(server_dsn: str) -> AsyncIterator[str]:
    async with scratch_database(server_dsn, "chimes_caps_shard_a") as dsn:
        yield dsn


@pytest.fixture
async def shard_b(second_server_dsn: str) -> AsyncIterator[str]:
    async with scratch_database(second_server_dsn, "chimes_caps_shard_b") as dsn:
        yield dsn


@pytest.fixture
async def database_url(database_url: str, shard_a: str, shard_b: str) -> str:
    """The catalog, whose map gives HOMES a and b to the shards before any role starts."""
    await add_shards(database_url, (shard_a, *HOMES["a"]), (shard_b, *HOMES["b"]))
    return database_url


async def set_cap(database_url: str, *args: str) -> None:
    """`chimes cap set`, as an operator runs it against a catalog with shards."""
    result = await asyncio.to_thread(CliRunner().invoke, cli, ["cap", "set", *args, "--database-url", database_url])
    assert result.exit_code == 0, result.output


async def job_in(client: httpx.AsyncClient, home: str, path: str, target: Target, *, token: str | None = None,
                 tags: tuple[str, ...] = ()) -> str:
    """A job of the token's owner (team-a by default) whose partition lies in ``home``, calling ``path``."""
    owner = "team-b" if token else "team-a"
    first, last = HOMES[home]
    key = next(k for k in (f"{home}{path}-{i}" for i in range(100_000)) if first <= partition_of_key(owner, k) <= last)
    body = {"name": f"{home}{path}", "schedule": {"cron": "0 0 1 1 *"}, "tags": list(tags), "concurrency": "allow",
            "task": {"type": "http", "url": target.url + path}}
    headers = {"Idempotency-Key": key, **(auth_as(token) if token else {})}
    created = await client.post("/jobs", json=body, headers=headers)
    assert created.status_code == 201, created.text
    job_id = created.json()["jobId"]
    assert first <= partition_of(uuid.UUID(job_id)) <= last
    return str(job_id)


async def run_now(client: httpx.AsyncClient, job_id: str, times: int, token: str | None = None) -> None:
    for _ in range(times):
        started = await client.post(f"/jobs/{job_id}/runs", headers=auth_as(token) if token else {})
        assert started.status_code == 202, started.text


async def slots(database_url: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(database_url)
    try:
        return await conn.fetch("SELECT * FROM cap_slots")
    finally:
        await conn.close()


async def test_an_owner_cap_of_one_holds_across_two_shards(
    processes: Processes, client: httpx.AsyncClient, tokens: dict[str, str], target: Target, database_url: str
) -> None:
    await set_cap(database_url, "owner:team-a", "1")
    target.delays["/capped"] = target.delays["/free"] = lambda n: 0.4
    on_a = await job_in(client, "a", "/capped", target)
    on_b = await job_in(client, "b", "/capped", target)
    on_catalog = await job_in(client, "catalog", "/capped", target)
    free = await job_in(client, "a", "/free", target, token=tokens["team-b"])  # team-b: under no cap
    processes.worker("worker-1", concurrency=10)
    processes.worker("worker-2", concurrency=10)
    for job_id in (on_a, on_b, on_catalog):
        await run_now(client, job_id, 3)
    await run_now(client, free, 3, tokens["team-b"])
    await wait_for(lambda: len(target.calls) == 12, timeout=60, what="every run, in the end")
    # Never two of team-a's runs answered at once, wherever they live: each began after the one
    # before had ended.
    assert target.most_in_flight["/capped"] == 1
    starts = sorted(c.received_at for c in target.calls_to("/capped"))
    assert all(later - earlier >= 0.39 for earlier, later in itertools.pairwise(starts)), starts
    assert target.most_in_flight["/free"] == 3  # team-b's runs under no cap, all at once
    await wait_for(lambda: _no_slots(database_url), timeout=10, what="every slot freed by the runs' outcomes")


async def _no_slots(database_url: str) -> bool:
    return not await slots(database_url)


async def test_a_fleet_wide_tag_cap_holds_across_two_shards_and_two_owners(
    processes: Processes, client: httpx.AsyncClient, tokens: dict[str, str], target: Target, database_url: str
) -> None:
    await set_cap(database_url, "tag:db-heavy", "1", "--fleet-wide")
    target.delays["/heavy"] = lambda n: 0.4
    on_a = await job_in(client, "a", "/heavy", target, tags=("db-heavy",))
    on_b = await job_in(client, "b", "/heavy", target, token=tokens["team-b"], tags=("db-heavy",))
    processes.worker("worker-1", concurrency=10)
    processes.worker("worker-2", concurrency=10)
    await run_now(client, on_a, 4)
    await run_now(client, on_b, 4, tokens["team-b"])
    await wait_for(lambda: len(target.calls) == 8, timeout=60, what="every run, in the end")
    starts = sorted(c.received_at for c in target.calls)
    assert all(later - earlier >= 0.39 for earlier, later in itertools.pairwise(starts)), starts
    assert target.most_in_flight == {"/heavy": 1}
    assert {c.headers["X-Chimes-Job-Id"] for c in target.calls} == {on_a, on_b}
    await wait_for(lambda: _no_slots(database_url), timeout=10, what="every slot freed by the runs' outcomes")


async def test_a_killed_workers_slot_lapses_and_the_cap_is_used_again_never_exceeded(
    processes: Processes, client: httpx.AsyncClient, target: Target, database_url: str
) -> None:
    await set_cap(database_url, "owner:team-a", "1")
    target.delays["/first"] = lambda n: 120.0  # the killed worker's call never ends by itself
    target.delays["/second"] = lambda n: 5.0
    first = await job_in(client, "a", "/first", target)
    second = await job_in(client, "b", "/second", target)
    doomed = processes.worker("worker-1", lease_sec=3.0)
    await run_now(client, first, 1)
    await wait_for(lambda: target.calls_to("/first"), timeout=30, what="the first run to start on worker-1")
    [held] = await slots(database_url)
    assert (held["holder"], held["scope"], held["name"]) == ("worker-1", "owner", "team-a")
    assert held["shard_id"] == 1  # shard A's run
    doomed.kill()  # SIGKILL: nothing freed, nothing handed back
    assert doomed.proc.returncode == -signal.SIGKILL
    killed_at = time.time()
    [still_held] = await slots(database_url)  # as it was left: the lease lapses within 3 s of the last renewal
    assert still_held["expires_at"].timestamp() <= killed_at + 3.0

    processes.worker("worker-2", lease_sec=3.0)
    await run_now(client, second, 1)
    await wait_for(lambda: target.calls_to("/second"), timeout=30, what="the second run, once the slot lapsed")
    # Not before the killed worker's slot lapsed: the cap was never exceeded meanwhile.
    assert target.calls_to("/second")[0].received_at >= still_held["expires_at"].timestamp()
    [taken] = await slots(database_url)
    assert taken["holder"] == "worker-2"


async def test_a_callback_run_keeps_its_slot_until_its_target_reports(
    processes: Processes, client: httpx.AsyncClient, target: Target, database_url: str
) -> None:
    """A target that answers 202 reports the outcome itself: the run is still running, on shard A,
    and keeps its slot past the worker's lease until the target completes it."""
    await set_cap(database_url, "owner:team-a", "1")
    target.responders["/accepts"] = lambda n: 202
    accepting = await job_in(client, "a", "/accepts", target)
    assert (await client.patch(f"/jobs/{accepting}", json={"task": {"type": "http", "url": target.url + "/accepts",
                                                                    "callback": True}})).status_code == 200
    later = await job_in(client, "b", "/later", target)
    processes.worker("worker-1", lease_sec=3.0)
    await run_now(client, accepting, 1)
    [call] = await wait_for(lambda: target.calls_to("/accepts"), timeout=30, what="the callback run to start")
    [first] = await wait_for(lambda: slots(database_url), timeout=10, what="its slot")
    await run_now(client, later, 1)
    # Well past the lease the slot was taken with: renewed all along, and the cap still full.
    await wait_for(lambda: _catalog_past(database_url, first["expires_at"].timestamp() + 1.0), timeout=20,
                   what="the first lease of the slot to pass")
    assert target.calls_to("/later") == []
    [kept] = await slots(database_url)
    assert kept["run_id"] == uuid.UUID(call.run_id) and kept["expires_at"] > first["expires_at"]
    done = await client.post(f"/runs/{call.run_id}/complete",
                             json={"leaseToken": call.headers["X-Chimes-Lease-Token"], "status": "succeeded"})
    assert done.status_code == 200, done.text
    await wait_for(lambda: target.calls_to("/later"), timeout=20, what="the next run once the target reported")


async def _catalog_past(database_url: str, epoch: float) -> bool:
    conn = await asyncpg.connect(database_url)
    try:
        return bool(await conn.fetchval("SELECT extract(epoch FROM now()) > $1", epoch))
    finally:
        await conn.close()


async def test_a_worker_cut_off_from_the_catalog_stops_its_capped_runs_before_their_slots_lapse(
    client: httpx.AsyncClient, tokens: dict[str, str], target: Target, database_url: str, shard_a: str
) -> None:
    """The worker can still reach its shard but no longer the catalog: its slots are not renewed, so
    it stops the capped run before they lapse and another worker could take them. A run under no cap
    goes on, its lease on the shard still extended, and more are claimed."""
    await set_cap(database_url, "owner:team-a", "1")
    target.delays["/long"] = target.delays["/uncapped"] = lambda n: 120.0
    long_job = await job_in(client, "a", "/long", target)
    uncapped = await job_in(client, "a", "/uncapped", target, token=tokens["team-b"])
    catalog = await db.create_pool(database_url, max_size=2)
    shard_pool = await db.create_pool(shard_a, max_size=4)
    config = replace(FAST_WORKER, heartbeat_every_sec=FAST_WORKER.lease_sec / 3)  # as `chimes worker` has it
    worker = Worker(shard_pool, shard_a, config, worker_id="cut-off", cap_slots=CapSlots(catalog), shard_id=1)
    task = asyncio.create_task(worker.run())
    try:
        await run_now(client, long_job, 1)
        await run_now(client, uncapped, 1, tokens["team-b"])
        [capped] = await wait_for(lambda: target.calls_to("/long"), timeout=30, what="the capped run to start")
        [free] = await wait_for(lambda: target.calls_to("/uncapped"), timeout=30, what="the other run to start")
        catalog.terminate()  # from here on, every renewal fails
        cut_at = time.time()
        await wait_for(lambda: uuid.UUID(capped.run_id) not in worker._running, timeout=FAST_WORKER.lease_sec + 2,
                       what="the capped run to be stopped")
        stopped_at = time.time()
        [left] = await slots(database_url)  # as the last renewal left it
        assert stopped_at < left["expires_at"].timestamp(), "stopped only after its slot had lapsed"
        # Meanwhile the heartbeat went on extending the leases on the shard, though the catalog failed.
        assert await _lease_past(shard_a, free.run_id, cut_at + FAST_WORKER.lease_sec)
        assert set(worker._running) == {uuid.UUID(free.run_id)}
        # Runs under no cap are still claimed from the shard, by the caps last read from the catalog.
        await run_now(client, uncapped, 1, tokens["team-b"])
        await wait_for(lambda: len(target.calls_to("/uncapped")) == 2, timeout=10,
                       what="another uncapped run, claimed while the catalog does not answer")
    finally:
        worker.stop()
        await asyncio.gather(task, return_exceptions=True)
        await shard_pool.close()


async def _lease_past(url: str, run_id: str, epoch: float) -> bool:
    conn = await asyncpg.connect(url)
    try:
        return bool(await conn.fetchval("SELECT extract(epoch FROM l.expires_at) > $2 FROM leases_in_force l"
                                        " JOIN runs r ON r.run_id = l.run_id AND r.lease_token = l.token"
                                        " WHERE l.run_id = $1",
                                        uuid.UUID(run_id), epoch))
    finally:
        await conn.close()
