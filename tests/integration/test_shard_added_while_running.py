"""A shard added while the API runs: the catalog's fence (migration 0010) keeps a router that has not
reloaded the map from leaving a job in the catalog, and `add` finds a job created while it checked
(docs/scaling.md, "Shards")."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest

from chimes.api.app import create_app
from chimes.cli.runtime import api_server
from chimes.ids import partition_of, partition_of_key
from chimes.store import db
from chimes.store.queries import sql
from chimes.store.shards import ShardMapError, give_range, load_map
from tests.conftest import scratch_database
from tests.helpers import add_shards, auth_as, wait_for

pytestmark = pytest.mark.own_shard_map  # databases and a shard map of its own, whatever --shards says

SHARD_RANGE = (0, 511)


@pytest.fixture
async def shard_url(server_dsn: str) -> AsyncIterator[str]:
    async with scratch_database(server_dsn, "chimes_added_shard") as dsn:
        yield dsn


@pytest.fixture
async def stale_api(database_url: str, tokens: dict[str, str]) -> AsyncIterator[httpx.AsyncClient]:
    """The API with the map read at start (empty) and not followed: only the fence tells it of a change."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = api_server(create_app(database_url, pool_size=4, follow_map_every_sec=3600), "127.0.0.1",
                        sock.getsockname()[1])
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await wait_for(lambda: server.started or task.done(), timeout=10, what="API start")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}",
                                 headers=auth_as(tokens["team-a"]), timeout=30) as client:
        yield client
    server.stop()
    await task
    sock.close()


def key_in(first: int, last: int, skip: int = 0) -> str:
    return [k for k in (f"key-{i}" for i in range(100_000)) if first <= partition_of_key("team-a", k) <= last][skip]


async def create(client: httpx.AsyncClient, name: str, key: str | None = None) -> uuid.UUID:
    body = {"name": name, "schedule": {"cron": "@hourly"}, "task": {"type": "http", "url": "http://127.0.0.1:9/"}}
    created = await client.post("/jobs", json=body, headers={"Idempotency-Key": key} if key else {})
    assert created.status_code == 201, created.text
    return uuid.UUID(created.json()["jobId"])


async def outside_the_range(client: httpx.AsyncClient) -> uuid.UUID:
    """A job in the catalog outside SHARD_RANGE (with the empty map the API makes random ids, and
    `add` refuses partitions that hold jobs): created until one falls there, the others deleted."""
    for attempt in range(40):
        job_id = await create(client, f"before-{attempt}")
        if partition_of(job_id) > SHARD_RANGE[1]:
            return job_id
        assert (await client.delete(f"/jobs/{job_id}")).status_code == 204
    raise AssertionError("40 random job ids, none outside the range")


async def job_ids(url: str) -> set[uuid.UUID]:
    conn = await asyncpg.connect(url)
    try:
        return {r["job_id"] for r in await conn.fetch("SELECT job_id FROM jobs")}
    finally:
        await conn.close()


async def test_the_catalog_finds_a_jobs_partition_as_chimes_does(pool: asyncpg.Pool) -> None:
    ids = [uuid.uuid4() for _ in range(2000)] + [uuid.UUID(int=0), uuid.UUID(int=(1 << 128) - 1)]
    rows = await pool.fetch("SELECT id, chimes_partition_of(id) AS partition FROM unnest($1::uuid[]) AS id", ids)
    assert {r["id"]: r["partition"] for r in rows} == {i: partition_of(i) for i in ids}


async def test_a_router_with_the_old_map_creates_the_job_on_the_new_shard(
    stale_api: httpx.AsyncClient, database_url: str, shard_url: str
) -> None:
    before = await outside_the_range(stale_api)
    await add_shards(database_url, (shard_url, *SHARD_RANGE))
    # This API still routes by the empty map, so it makes random ids and sends them to the catalog.
    # The first in the range is refused there: the API reloads the map and creates it on the shard
    # (and from then on routes by the new map).
    made = []
    for skip in range(40):
        made.append(await create(stale_api, f"after-{skip}", key_in(*SHARD_RANGE, skip)))
        if partition_of(made[-1]) <= SHARD_RANGE[1]:
            break
    moved = made[-1]
    assert partition_of(moved) <= SHARD_RANGE[1], "40 random job ids, none in the range"
    assert await job_ids(shard_url) == {moved}
    assert await job_ids(database_url) == {before, *made[:-1]}  # none in the shard's range
    assert (await stale_api.get(f"/jobs/{moved}")).json()["name"] == f"after-{len(made) - 1}"
    assert (await stale_api.get(f"/jobs/{before}")).json()["name"].startswith("before")


async def test_the_catalog_refuses_a_job_of_a_shards_partition(pool: asyncpg.Pool, database_url: str,
                                                               shard_url: str) -> None:
    await add_shards(database_url, (shard_url, *SHARD_RANGE))
    inside = next(i for i in iter(uuid.uuid4, None) if partition_of(i) <= SHARD_RANGE[1])
    with pytest.raises(asyncpg.PostgresError) as refused:
        await pool.execute("INSERT INTO jobs (job_id) VALUES ($1)", inside)  # the fence comes first
    assert refused.value.sqlstate == "CH001" and "held by a shard" in str(refused.value)


async def test_a_job_created_while_add_checks_is_found_and_the_add_refused(
    stale_api: httpx.AsyncClient, database_url: str, shard_url: str
) -> None:
    conn = await db.connect(database_url)
    try:
        horizon = await conn.fetchval(sql("snapshot_horizon"))  # as add_shard takes it, before its scan
        # ... the scan found nothing; meanwhile creates commit, one of them in the range. (With the
        # empty map, the API makes random ids: half of them fall in the range.)
        made = [await create(stale_api, f"late-{i}") for i in range(40)]
        late = next(job_id for job_id in made if partition_of(job_id) <= SHARD_RANGE[1])
        late_partitions = sorted({partition_of(j) for j in made if partition_of(j) <= SHARD_RANGE[1]})
        with pytest.raises(ShardMapError, match=f"partitions {late_partitions[0]}[, ]"):
            await give_range(conn, shard_url, *SHARD_RANGE, horizon)
        assert (await load_map(conn)).ranges == ()  # nothing changed
    finally:
        await conn.close()
    assert late in await job_ids(database_url)
