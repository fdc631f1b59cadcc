"""The API with a shard map: every job-scoped request reaches the job's database, whichever it is
(the catalog holds partitions 512-1023, a shard 0-511), and lists span both (docs/scaling.md)."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit

import asyncpg
import httpx
import pytest
from prometheus_client import REGISTRY

from chimes import __version__
from chimes.ids import partition_of, partition_of_key
from chimes.scheduler.node import SchedulerNode
from chimes.store import db
from chimes.store.shards import add_shard
from chimes.worker.budget import SlotBudget
from chimes.worker.tiers import TierPolicy
from chimes.worker.worker import Worker
from tests.conftest import scratch_database
from tests.helpers import wait_for
from tests.integration.fleet import FAST_SCHEDULER, FAST_WORKER
from tests.integration.test_dashboard import csrf_of, signed_in
from tests.integration.test_metrics import scrape, value
from tests.target import Target

SIDES = {"shard": (0, 511), "catalog": (512, 1023)}

pytestmark = pytest.mark.own_shard_map  # a catalog and one shard of its own, whatever --shards says


@pytest.fixture
async def shard_url(server_dsn: str) -> AsyncIterator[str]:
    async with scratch_database(server_dsn, "chimes_api_shard") as dsn:
        yield dsn


@pytest.fixture
async def database_url(single_database_url: str, shard_url: str) -> str:
    """The catalog, whose map gives 0-511 to the shard before the API starts."""
    conn = await db.connect(single_database_url)
    try:
        await add_shard(conn, shard_url, *SIDES["shard"])
    finally:
        await conn.close()
    return single_database_url


def key_in(owner: str, first: int, last: int, skip: int = 0) -> str:
    keys = (f"key-{i}" for i in range(100_000))
    return [key for key in keys if first <= partition_of_key(owner, key) <= last][skip]


async def create(client: httpx.AsyncClient, side: str, skip: int = 0) -> uuid.UUID:
    body = {"name": f"{side}-{skip}", "schedule": {"cron": "0 * * * *"},
            "task": {"type": "http", "url": "http://127.0.0.1:9/x"}, "concurrency": "allow"}
    created = await client.post("/jobs", json=body, headers={"Idempotency-Key": key_in("team-a", *SIDES[side], skip)})
    assert created.status_code == 201, created.text
    job_id = uuid.UUID(created.json()["jobId"])
    first, last = SIDES[side]
    assert first <= partition_of(job_id) <= last
    return job_id


async def rows(url: str, query: str, *args: object) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetch(query, *args)
    finally:
        await conn.close()


@pytest.mark.parametrize("side", ["shard", "catalog"])
async def test_every_job_request_reaches_the_jobs_database(client: httpx.AsyncClient, database_url: str,
                                                           shard_url: str, side: str) -> None:
    home, other = (shard_url, database_url) if side == "shard" else (database_url, shard_url)
    job_id = await create(client, side)
    assert [r["job_id"] for r in await rows(home, "SELECT job_id FROM jobs")] == [job_id]
    assert await rows(other, "SELECT job_id FROM jobs") == []

    paused = await client.patch(f"/jobs/{job_id}", json={"paused": True})
    assert paused.status_code == 200 and paused.json()["paused"] is True, paused.text
    assert [r["paused"] for r in await rows(home, "SELECT paused FROM jobs")] == [True]
    assert (await client.get(f"/jobs/{job_id}")).json()["version"] == 2

    started = await client.post(f"/jobs/{job_id}/runs")
    assert started.status_code == 202, started.text
    run_id = started.json()["runId"]
    assert (await client.get(f"/runs/{run_id}")).json()["jobId"] == str(job_id)
    cancelled = await client.post(f"/runs/{run_id}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text

    end = datetime.now(UTC).replace(minute=30, second=0, microsecond=0) - timedelta(hours=1)
    backfilled = await client.post(f"/jobs/{job_id}/backfill",
                                   json={"start": (end - timedelta(hours=3)).isoformat(), "end": end.isoformat()})
    assert backfilled.status_code == 202 and backfilled.json()["created"] == 3, backfilled.text
    listed = (await client.get(f"/jobs/{job_id}/runs")).json()["runs"]
    assert len(listed) == 4 and len(await rows(home, "SELECT run_id FROM runs")) == 4

    assert (await client.delete(f"/jobs/{job_id}")).status_code == 204
    gone = await client.get(f"/jobs/{job_id}")
    assert gone.status_code == 404 and gone.json()["error"] == "job_deleted", gone.text  # its runs are kept
    assert await rows(home, "SELECT job_id FROM jobs") == []


async def test_lists_and_the_queue_span_both_databases(client: httpx.AsyncClient, tokens: dict[str, str]) -> None:
    by_side = {side: [await create(client, side, skip) for skip in range(3)] for side in SIDES}
    made = sorted(by_side["shard"] + by_side["catalog"])
    seen: list[uuid.UUID] = []
    cursor = None
    while True:
        params = {"limit": "2", **({"cursor": cursor} if cursor else {})}
        page = (await client.get("/jobs", params=params)).json()
        seen += [uuid.UUID(j["jobId"]) for j in page["jobs"]]
        cursor = page["nextCursor"]
        if cursor is None:
            break
    assert seen == made  # each job once, in creation order, across both databases
    for job_id in (by_side["shard"][0], by_side["catalog"][0]):  # one queued run in each database
        assert (await client.post(f"/jobs/{job_id}/runs")).status_code == 202
    queue = (await client.get("/queue", headers={"Authorization": f"Bearer {tokens['admin']}"})).json()
    assert sum(tier["depth"] for tier in queue["tiers"]) == 2
    samples = await scrape(client)
    assert sum(v for (name, _), v in samples.items() if name == "chimes_queue_depth") == 2
    assert value(samples, "chimes_partitions_unleased") == 2 * 1024  # no node runs: each home's rows


async def test_healthz_names_a_shard_that_is_down_and_stays_up(api_url: str, client: httpx.AsyncClient,
                                                                server_dsn: str, shard_url: str) -> None:
    job_id = await create(client, "catalog")
    async with httpx.AsyncClient(base_url=api_url) as anonymous:
        healthy = await anonymous.get("/healthz")
        assert (healthy.status_code, healthy.json()) == (200, {"status": "ok", "version": __version__,
                                                               "shards": {"1": "ok"}})
        admin = await asyncpg.connect(server_dsn)
        try:
            await admin.execute(f"DROP DATABASE {urlsplit(shard_url).path.lstrip('/')} WITH (FORCE)")
        finally:
            await admin.close()
        degraded = await anonymous.get("/healthz")
    assert degraded.status_code == 200, degraded.text  # the catalog's jobs are still served
    assert degraded.json()["shards"]["1"].startswith("unavailable (")
    assert "/" not in degraded.json()["shards"]["1"] and "host" not in degraded.text  # no host named
    assert (await client.get(f"/jobs/{job_id}")).status_code == 200


async def test_notifications_of_both_databases_page_newest_first(client: httpx.AsyncClient, database_url: str,
                                                                  shard_url: str) -> None:
    base = datetime(2026, 11, 1, tzinfo=UTC)
    made = []  # (created_at, id, database): alternating databases, a minute apart
    for i in range(6):
        url = shard_url if i % 2 else database_url
        side = "shard" if i % 2 else "catalog"
        made.append((base + timedelta(minutes=i), uuid.uuid4(), side))
        conn = await asyncpg.connect(url)
        try:
            await conn.execute("INSERT INTO notifications (notification_id, job_id, owner, kind, url, payload, "
                               "created_at) VALUES ($1, $2, 'team-a', 'run_failed', 'http://127.0.0.1:9/', '{}', $3)",
                               made[-1][1], uuid.uuid4(), made[-1][0])
        finally:
            await conn.close()
    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": "4", **({"cursor": cursor} if cursor else {})}
        page = (await client.get("/notifications", params=params)).json()
        seen += [n["notificationId"] for n in page["notifications"]]
        cursor = page["nextCursor"]
        if cursor is None:
            break
    assert seen == [str(notification_id) for _, notification_id, _ in reversed(made)]


async def test_the_dashboards_job_and_run_pages_and_buttons_reach_a_shards_job(
    client: httpx.AsyncClient, api_url: str, tokens: dict[str, str], shard_url: str
) -> None:
    job_id = await create(client, "shard")
    async with signed_in(api_url, tokens["team-a"]) as browser:
        page = await browser.get(f"/ui/jobs/{job_id}")
        assert page.status_code == 200 and "shard-0" in page.text, page.text
        csrf = csrf_of(page.text)
        paused = await browser.post(f"/ui/jobs/{job_id}/pause", data={"csrf": csrf})
        assert paused.status_code == 303, paused.text
        assert [r["paused"] for r in await rows(shard_url, "SELECT paused FROM jobs")] == [True]
        started = await browser.post(f"/ui/jobs/{job_id}/run", data={"csrf": csrf})
        assert started.status_code == 303, started.text
        [run_id] = [r["run_id"] for r in await rows(shard_url, "SELECT run_id FROM runs")]
        run_page = await browser.get(f"/ui/runs/{run_id}")
        assert run_page.status_code == 200 and "shard-0" in run_page.text, run_page.text
        cancelled = await browser.post(f"/ui/runs/{run_id}/cancel", data={"csrf": csrf})
        assert cancelled.headers["location"] == f"/ui/runs/{run_id}?notice=cancelled", cancelled.text
        rerun = await browser.post(f"/ui/runs/{run_id}/rerun", data={"csrf": csrf})
        assert rerun.status_code == 303 and rerun.headers["location"].endswith("?notice=started"), rerun.text
    assert len(await rows(shard_url, "SELECT run_id FROM runs")) == 2


async def test_the_dashboards_job_list_shows_both_databases_jobs_in_name_order(
    client: httpx.AsyncClient, api_url: str, tokens: dict[str, str]
) -> None:
    for side in SIDES:
        for skip in range(2):
            await create(client, side, skip)
    async with signed_in(api_url, tokens["team-a"]) as browser:
        page = (await browser.get("/ui/jobs")).text
    names = ["catalog-0", "catalog-1", "shard-0", "shard-1"]
    assert sorted(names, key=page.index) == names  # all four, in name order


async def test_a_run_is_found_while_another_shard_is_down(client: httpx.AsyncClient, server_dsn: str,
                                                          shard_url: str) -> None:
    job_id = await create(client, "catalog")
    run_id = (await client.post(f"/jobs/{job_id}/runs")).json()["runId"]
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute(f"DROP DATABASE {urlsplit(shard_url).path.lstrip('/')} WITH (FORCE)")
    finally:
        await admin.close()
    found = await client.get(f"/runs/{run_id}")
    assert found.status_code == 200 and found.json()["jobId"] == str(job_id), found.text
    assert (await client.get(f"/jobs/{job_id}")).status_code == 200


async def test_workers_of_one_process_share_their_slots_across_databases(
    client: httpx.AsyncClient, pool: asyncpg.Pool, database_url: str, shard_url: str, target: Target
) -> None:
    target.delays["/slow"] = lambda n: 1.0
    budget = SlotBudget(2)
    shard_pool = await db.create_pool(shard_url, max_size=4)
    # One owner's runs fill both slots here: what is shown is how the slots are shared between the
    # databases, not between owners (TierPolicy.owner_share, test_priority.py).
    config = replace(FAST_WORKER, concurrency=2, tiers=TierPolicy(owner_share=1.0))
    workers = [Worker(pool, database_url, config, worker_id="w-catalog", budget=budget),
               Worker(shard_pool, shard_url, config, worker_id="w-shard", budget=budget)]
    tasks = [asyncio.create_task(worker.run()) for worker in workers]
    try:
        async def start(side: str, skip: int) -> None:
            body = {"name": f"{side}-{skip}", "schedule": {"cron": "0 0 1 1 *"},
                    "task": {"type": "http", "url": f"{target.url}/slow"}}
            created = await client.post("/jobs", json=body,
                                        headers={"Idempotency-Key": key_in("team-a", *SIDES[side], skip)})
            assert (await client.post(f"/jobs/{created.json()['jobId']}/runs")).status_code == 202

        # Two runs on the shard alone: an idle catalog lends it its slot, so both start at once.
        await start("shard", 0)
        await start("shard", 1)
        await wait_for(lambda: len(target.calls) == 2, timeout=20, what="both shard runs to start")
        assert abs(target.calls[1].received_at - target.calls[0].received_at) < 0.9
        # Then one more on each: never more than the two slots at once, across both databases.
        await start("shard", 2)
        await start("catalog", 0)
        await wait_for(lambda: len(target.calls) == 4, timeout=20, what="the next two runs to start")
        # A slot frees when a first run's call ends, a second after it began.
        assert min(c.received_at for c in target.calls[2:]) - min(c.received_at for c in target.calls[:2]) > 0.95
        await wait_for(lambda: budget.in_use == 0, timeout=20, what="every slot given back")
    finally:
        for worker in workers:
            worker.stop()
        await asyncio.gather(*tasks)
        await shard_pool.close()


async def test_batch_runs_keep_to_the_processs_batch_share_across_databases(
    client: httpx.AsyncClient, pool: asyncpg.Pool, database_url: str, shard_url: str, target: Target
) -> None:
    """Batch runs may fill at most the batch share of a worker process (4 of 5 slots here), so a high
    run always finds a slot: with a backlog in both databases, each claim loop counting only its own
    batch runs would fill all five."""
    target.delays["/batch"] = lambda n: 2.0
    config = replace(FAST_WORKER, concurrency=5)
    cap = config.tiers.batch_cap(config.concurrency)
    assert cap == 4
    for side in SIDES:
        body = {"name": f"batch-{side}", "schedule": {"cron": "0 0 1 1 *"}, "priority": "batch",
                "concurrency": "allow", "task": {"type": "http", "url": f"{target.url}/batch"}}
        created = await client.post("/jobs", json=body, headers={"Idempotency-Key": key_in("team-a", *SIDES[side])})
        for _ in range(4):
            assert (await client.post(f"/jobs/{created.json()['jobId']}/runs")).status_code == 202
    budget = SlotBudget(config.concurrency)
    shard_pool = await db.create_pool(shard_url, max_size=4)
    workers = [Worker(pool, database_url, config, worker_id="w-catalog", budget=budget),
               Worker(shard_pool, shard_url, config, worker_id="w-shard", budget=budget)]
    tasks = [asyncio.create_task(worker.run()) for worker in workers]
    try:
        await wait_for(lambda: len(target.calls) >= cap, timeout=20, what="the first batch runs to start")
        first = min(c.received_at for c in target.calls)
        await wait_for(lambda: len(target.calls) > cap, timeout=20, what="a fifth batch run to start")
        fifth = sorted(c.received_at for c in target.calls)[cap]
        assert fifth - first > 1.5, "a fifth batch run started while four held the batch share"
        assert budget.batch_in_use <= cap
    finally:
        for worker in workers:
            worker.stop()
        await asyncio.gather(*tasks)
        await shard_pool.close()


async def test_a_job_quota_holds_across_both_databases(client: httpx.AsyncClient, pool: asyncpg.Pool) -> None:
    await pool.execute("INSERT INTO owners (owner, job_quota) VALUES ('team-a', 3) "
                       "ON CONFLICT (owner) DO UPDATE SET job_quota = 3")
    # Six creates at once, three on each database: exactly three get in, whichever they are.
    async def attempt(side: str, skip: int) -> int:
        body = {"name": f"{side}-{skip}", "schedule": {"cron": "@hourly"},
                "task": {"type": "http", "url": "http://127.0.0.1:9/x"}}
        key = key_in("team-a", *SIDES[side], skip)
        return (await client.post("/jobs", json=body, headers={"Idempotency-Key": key})).status_code

    codes = await asyncio.gather(*(attempt(side, skip) for side in SIDES for skip in range(3)))
    assert sorted(codes) == [201, 201, 201, 429, 429, 429], codes
    listed = (await client.get("/jobs")).json()["jobs"]
    assert len(listed) == 3
    refused = await client.post("/jobs", json={"name": "one-more", "schedule": {"cron": "@hourly"},
                                               "task": {"type": "http", "url": "http://127.0.0.1:9/x"}})
    assert refused.status_code == 429 and refused.json()["error"] == "job_quota_exceeded", refused.text
    assert (await client.delete(f"/jobs/{listed[0]['jobId']}")).status_code == 204
    for side in SIDES:  # room for one again, on either database
        again = await attempt(side, 5)
        assert again == 201 if side == "shard" else again == 429, (side, again)


async def test_the_fleet_page_shows_each_database_and_adds_them_up(
    client: httpx.AsyncClient, pool: asyncpg.Pool, database_url: str, shard_url: str, api_url: str,
    server_dsn: str, tokens: dict[str, str], target: Target,
) -> None:
    shard_pool = await db.create_pool(shard_url, max_size=4)
    # One process's node and worker on each home, under one id each, as `chimes scheduler` and
    # `chimes worker` run them.
    serves = [frozenset(range(512, 1024)), frozenset(range(512))]
    nodes = [SchedulerNode(home, FAST_SCHEDULER, node_id="one-node", serves=partitions)
             for home, partitions in zip((pool, shard_pool), serves, strict=True)]
    workers = [Worker(home, url, FAST_WORKER, worker_id="one-worker")
               for home, url in ((pool, database_url), (shard_pool, shard_url))]
    tasks = [asyncio.create_task(role.run()) for role in (*nodes, *workers)]
    try:
        for side in SIDES:
            body = {"name": f"{side}-tick", "schedule": {"cron": "* * * * * *"},
                    "task": {"type": "http", "url": f"{target.url}/{side}"}}
            created = await client.post("/jobs", json=body, headers={"Idempotency-Key": key_in("team-a", *SIDES[side])})
            assert created.status_code == 201, created.text
        await wait_for(lambda: all(len(target.calls_to(f"/{side}")) >= 2 for side in SIDES), timeout=30,
                       what="both databases' jobs to run")
        await wait_for(lambda: all(len(node.leases.held) == 1024 for node in nodes), timeout=10,
                       what="every lease row held on both homes")
        # The process's partitions gauge counts each partition on its own home: 1,024, not twice that.
        assert REGISTRY.get_sample_value("chimes_partitions_owned") == 1024
        async with signed_in(api_url, tokens["admin"]) as admin:
            html = (await admin.get("/ui/fleet")).text
        shards_card = html[html.index('id="shards"'):]
        shards_card = shards_card[:shards_card.index("</section>")]
        catalog_row, shard_row = re.findall(r"<tr><td>(catalog|shard \d+)</td>(.*?)</tr>", shards_card, re.DOTALL)
        assert catalog_row[0] == "catalog" and "512\u20131023" in catalog_row[1] and "512/512" in catalog_row[1]
        assert shard_row[0].startswith("shard") and "0\u2013511" in shard_row[1] and "512/512" in shard_row[1]
        # Added up: the node holds all 1,024 partitions, each on the home that has it, and is listed once.
        assert "1024/1024" in html and html.count("<code class=\"small\">one-node</code>") == 1
        assert re.search(r"Fire lag, last 10 min.*?\(([\d,]+) runs", html, re.DOTALL).group(1) not in ("0", "1")

        for role in (*nodes[1:], *workers[1:]):  # the shard's roles stop, then its database goes
            role.stop()
        await asyncio.gather(*tasks[1:2], *tasks[3:])
        await shard_pool.close()
        admin_conn = await asyncpg.connect(server_dsn)
        try:
            await admin_conn.execute(f"DROP DATABASE {urlsplit(shard_url).path.lstrip('/')} WITH (FORCE)")
        finally:
            await admin_conn.close()
        async with signed_in(api_url, tokens["admin"]) as admin:
            down = await admin.get("/ui/fleet")
        assert down.status_code == 200, down.text
        assert re.search(r"<td>shard \d+</td>.*?unavailable \(\w+\)", down.text, re.DOTALL), down.text
        assert "512/1024</span><span class=\"label\">partitions held, 512 unheld" in down.text  # the shard's
    finally:
        for role in (*nodes, *workers):
            role.stop()
        await asyncio.gather(*tasks)
        await shard_pool.close()
