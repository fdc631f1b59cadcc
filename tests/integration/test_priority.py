"""Priority tiers: a backlog of batch runs never delays a high-priority run, and batch still moves."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime

import asyncpg
import httpx

from chimes.store.working import ClaimedRun
from chimes.worker.worker import Worker
from tests.helpers import Homes, auth_as, wait_for
from tests.integration.fleet import FAST_WORKER, Fleet, running_fleet
from tests.target import Target

BACKLOG = 10_000


async def queue_batch_backlog(client: httpx.AsyncClient, target: Target, homes: Homes) -> str:
    """10,000 batch runs waiting in the queue, written straight into the tables for speed."""
    job_id = (await client.post("/jobs", json={
        "name": "backlog", "schedule": {"cron": "0 0 1 1 *"}, "priority": "batch", "concurrency": "allow",
        "task": {"type": "http", "url": target.url + "/batch"}})).json()["jobId"]
    await (await homes.for_job(job_id)).execute("""
        WITH made AS (
            INSERT INTO runs (run_id, scheduled_at, job_id, owner, partition_id, job_version, trigger, priority)
            SELECT gen_random_uuid(), now() - make_interval(secs => n), $1, 'team-a', 0, 1, 'manual', 2
            FROM generate_series(1, $2) AS n
            RETURNING run_id, scheduled_at, job_id
        )
        INSERT INTO run_queue (tier, run_id, scheduled_at, job_id) SELECT 2, run_id, scheduled_at, job_id FROM made
    """, uuid.UUID(job_id), BACKLOG)
    return job_id


async def test_high_priority_run_starts_at_once_behind_a_batch_backlog(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes, tokens: dict[str, str]
) -> None:
    target.delays["/batch"] = lambda n: 1.0  # batch runs keep the worker busy
    await queue_batch_backlog(client, target, homes)
    await wait_for(lambda: _running(homes, 2, fleet.worker.config.tiers.batch_cap(fleet.worker.config.concurrency)),
                   timeout=20, what="batch runs to fill their share of the worker")
    admin = auth_as(tokens["admin"])  # only an admin grants priority high
    urgent = (await client.post("/jobs", json={"name": "urgent", "schedule": {"cron": "0 0 1 1 *"},
                                               "priority": "high",
                                               "task": {"type": "http", "url": target.url + "/high"}},
                                headers=admin)).json()
    asked_at = datetime.now(UTC)
    run_id = (await client.post(f"/jobs/{urgent['jobId']}/runs", headers=admin)).json()["runId"]
    [call] = await wait_for(lambda: target.calls_to("/high"), timeout=10, what="the high-priority run")
    run = await homes.fetchrow(urgent["jobId"], "SELECT * FROM runs WHERE run_id = $1", uuid.UUID(run_id))
    assert run["status"] in ("running", "succeeded")
    assert call.received_at - asked_at.timestamp() < 2.0  # the target of the 2 s start promise
    # Batch never held every slot, and the backlog keeps moving underneath.
    assert await homes.total("SELECT count(*) FROM run_queue WHERE tier = 2") < BACKLOG


async def _running(homes: Homes, tier: int, count: int) -> bool:
    return await homes.total("SELECT count(*) FROM runs WHERE priority = $1 AND status = 'running'", tier) >= count


async def test_batch_is_not_starved_by_a_stream_of_normal_runs(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    """Normal runs arrive faster than the worker finishes them; batch runs still start now and then."""
    target.delays["/normal"] = lambda n: 0.5
    await queue_batch_backlog(client, target, homes)
    normal = (await client.post("/jobs", json={"name": "stream", "schedule": {"cron": "0 0 1 1 *"},
                                               "concurrency": "allow",
                                               "task": {"type": "http", "url": target.url + "/normal"}})).json()
    for _ in range(100):
        assert (await client.post(f"/jobs/{normal['jobId']}/runs")).status_code == 202
    await wait_for(lambda: _normal_done(homes, 100), timeout=30, what="the normal stream to be worked off")
    first_batch = min((r["started_at"] for r in await homes.fetch("SELECT started_at FROM runs WHERE priority = 2")
                       if r["started_at"] is not None), default=None)
    last_normal = max(r["started_at"] for r in await homes.fetch("SELECT started_at FROM runs WHERE priority = 1"))
    assert first_batch is not None and first_batch < last_normal  # batch ran while normal work was waiting


async def _normal_done(homes: Homes, count: int) -> bool:
    return await homes.total("SELECT count(*) FROM runs WHERE priority = 1 AND status = 'succeeded'") >= count


async def flood_a_share_of_the_worker(fleet: Fleet, client: httpx.AsyncClient, target: Target) -> int:
    """Team A queues 40 long runs, more than the worker has slots, until they hold A's share of it."""
    target.delays["/long"] = lambda n: 30.0
    flood = (await client.post("/jobs", json={"name": "flood", "schedule": {"cron": "0 0 1 1 *"},
                                              "concurrency": "allow",
                                              "task": {"type": "http", "url": target.url + "/long"}})).json()
    for _ in range(40):
        assert (await client.post(f"/jobs/{flood['jobId']}/runs")).status_code == 202
    worker = fleet.workers[0].config
    share = worker.tiers.owner_cap(worker.concurrency)
    assert share < worker.concurrency
    await wait_for(lambda: len(target.calls_to("/long")) >= share or None, timeout=20,
                   what="team A's runs to fill its share of the worker")
    return share


async def assert_team_b_run_starts_at_once(client: httpx.AsyncClient, target: Target, tokens: dict[str, str]) -> None:
    team_b = auth_as(tokens["team-b"])
    quick = (await client.post("/jobs", json={"name": "quick", "schedule": {"cron": "0 0 1 1 *"},
                                              "task": {"type": "http", "url": target.url + "/quick"}},
                               headers=team_b)).json()
    asked_at = datetime.now(UTC)
    assert (await client.post(f"/jobs/{quick['jobId']}/runs", headers=team_b)).status_code == 202
    [call] = await wait_for(lambda: target.calls_to("/quick"), timeout=10, what="team B's run")
    assert call.received_at - asked_at.timestamp() < 2.0, "started within the 2 s start promise"


async def test_one_owners_flood_of_long_runs_leaves_room_for_another_owners_runs(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes, tokens: dict[str, str]
) -> None:
    """Team A queues more long runs than the worker has slots; team B's run still starts at once, since
    no owner holds more than its share of a worker (TierPolicy.owner_share)."""
    share = await flood_a_share_of_the_worker(fleet, client, target)
    await assert_team_b_run_starts_at_once(client, target, tokens)
    assert target.most_in_flight["/long"] == share, "team A never held more than its share"
    assert await homes.total("SELECT count(*) FROM run_queue") >= 40 - share, "the rest of team A's runs wait"


async def test_while_an_owner_holds_its_share_the_poll_backs_off_and_notify_still_starts_others_runs(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, tokens: dict[str, str]
) -> None:
    """A claim while team A holds its share skips A's runs, reading past every one of them queued, and
    finds nothing: the poll that sends it waits twice as long after each (Claimer.poll_wait). Team B's
    run, announced by its NOTIFY, still starts at once, not at the next poll."""
    share = await flood_a_share_of_the_worker(fleet, client, target)
    worker = fleet.workers[0]
    fruitless = record_fruitless_skips(worker)
    # Over a window of 20 polls (6 s here) nothing wakes the claim loop but the poll: no run is queued
    # and none of A's ends. At the poll's own pace it would send 20 such claims; backing off, a few.
    poll = worker.config.poll_every_sec
    await asyncio.sleep(20 * poll)
    assert len(fruitless) <= 4, f"{len(fruitless)} claims skipping team A in {20 * poll:.0f} s"

    await assert_team_b_run_starts_at_once(client, target, tokens)
    assert target.most_in_flight["/long"] == share, "team A never held more than its share"


def record_fruitless_skips(worker: Worker) -> list[float]:
    """When each of ``worker``'s claim cycles from now on that skipped owners at their share found nothing."""
    fruitless: list[float] = []
    claim_by_tier = worker._claimer.claim_by_tier

    async def recorded(limit: int) -> list[ClaimedRun]:
        claimed = await claim_by_tier(limit)
        if worker._claimer.skip_owners and not claimed:
            fruitless.append(time.monotonic())
        return claimed

    worker._claimer.claim_by_tier = recorded  # type: ignore[method-assign]
    return fruitless


async def test_an_owner_with_more_runs_than_its_share_gets_them_as_its_runs_end(
    pool: asyncpg.Pool, database_url: str, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    """One owner's burst, many times its share of the worker, queued when the worker had found the
    queue empty: as its runs end the worker claims the next of them, a batch at a time, rather than
    once a poll (a minute here). Its NOTIFY named that owner alone, so no claim skips the owner to
    look for others' runs: such a claim would read past every one of the burst's runs and find nothing."""
    target.delays["/burst"] = lambda n: 0.05
    job_id = (await client.post("/jobs", json={
        "name": "burst", "schedule": {"cron": "0 0 1 1 *"}, "concurrency": "allow",
        "task": {"type": "http", "url": target.url + "/burst"}})).json()["jobId"]

    async def queue_burst() -> None:  # written straight into the tables: no NOTIFY
        await (await homes.for_job(job_id)).execute("""
            WITH made AS (
                INSERT INTO runs (run_id, scheduled_at, job_id, owner, partition_id, job_version, trigger, priority)
                SELECT gen_random_uuid(), now() - make_interval(secs => n), $1, 'team-a', 0, 1, 'manual', 1
                FROM generate_series(1, 200) AS n
                RETURNING run_id, scheduled_at, job_id
            )
            INSERT INTO run_queue (tier, run_id, scheduled_at, job_id) SELECT 1, run_id, scheduled_at, job_id FROM made
        """, uuid.UUID(job_id))
    config = replace(FAST_WORKER, poll_every_sec=60.0)
    async with running_fleet(pool, database_url, homes, scheduler=None, worker=config) as fleet:
        await wait_for(fleet.listening, timeout=10, what="the worker to listen")
        worker = fleet.workers[0]
        await wait_for(lambda: worker._claimer.maybe_queued == set(), timeout=10,
                       what="the worker to find the queue empty")
        fruitless = record_fruitless_skips(worker)
        await queue_burst()
        assert (await client.post(f"/jobs/{job_id}/runs")).status_code == 202  # its NOTIFY wakes the worker
        await wait_for(lambda: _succeeded(homes, 201), timeout=20, what="every run of the burst to succeed")
    share = config.tiers.owner_cap(config.concurrency)
    assert target.most_in_flight["/burst"] == share, "the owner held its share of the worker, and no more"
    assert fruitless == [], "no claim skipped the only owner whose runs were queued"


async def _succeeded(homes: Homes, count: int) -> bool:
    return await homes.total("SELECT count(*) FROM runs WHERE status = 'succeeded'") >= count


async def test_only_an_admin_grants_priority_high(client: httpx.AsyncClient, homes: Homes,
                                                  tokens: dict[str, str]) -> None:
    """A team that could mark its own jobs high would go before every other team's runs."""
    job = {"name": "mine", "schedule": {"cron": "0 0 1 1 *"}, "task": {"type": "http", "url": "http://127.0.0.1:9/"}}
    refused = await client.post("/jobs", json=job | {"priority": "high"})
    assert refused.status_code == 403
    assert refused.json()["error"] == "priority_not_allowed" and refused.json()["field"] == "priority"
    assert refused.json()["message"].startswith("priority 'high' is granted by an admin: owner 'team-a' may use")
    assert await homes.total("SELECT count(*) FROM jobs") == 0, "nothing written"

    job_id = (await client.post("/jobs", json=job)).json()["jobId"]
    patched = await client.patch(f"/jobs/{job_id}", json={"priority": "high"})
    assert (patched.status_code, patched.json()["field"]) == (403, "priority")
    assert (await client.get(f"/jobs/{job_id}")).json()["priority"] == "normal"
    assert (await client.patch(f"/jobs/{job_id}", json={"priority": "batch"})).status_code == 200

    granted = await client.patch(f"/jobs/{job_id}", json={"priority": "high"}, headers=auth_as(tokens["admin"]))
    assert granted.status_code == 200 and granted.json()["priority"] == "high"
    assert (await client.patch(f"/jobs/{job_id}", json={"name": "renamed"})).json()["priority"] == "high", \
        "a team's other edits keep the priority an admin granted"
