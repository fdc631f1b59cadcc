"""`chimes shards rebalance` through the CLI: a catalog with most of the jobs and a shard with almost
none; the proposal changes nothing, `--apply` moves ranges until the two are within the promised
tolerance (docs/scaling.md, "Rebalancing"), and no job is lost or made twice."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest

from chimes.ids import partition_of
from chimes.store.rebalance import MIN_GAIN
from chimes.store.shards import load_map
from tests.conftest import scratch_database
from tests.e2e.processes import Processes
from tests.helpers import wait_for

pytestmark = [pytest.mark.own_shard_map,  # a catalog and a shard of its own, whatever --shards says
              pytest.mark.sharded_pass]  # in the second pass, scripts/test --sharded

JOBS = 240
SHARD_RANGE = "1000-1023"  # the shard starts with 24 of the 1,024 partitions, and about 2% of the jobs
MOVE_COMMAND = re.compile(r"chimes shards move (\d+)-(\d+) --to (\w+)")


@pytest.fixture
async def shard_url(second_server_dsn: str) -> AsyncIterator[str]:
    async with scratch_database(second_server_dsn, "chimes_e2e_rebalance") as dsn:
        yield dsn


async def run(processes: Processes, name: str, *args: str, timeout: float = 60) -> str:
    process = processes.start(name, "shards", *args)
    code = await process.exited(timeout=timeout)
    assert code == 0, process.output()
    return process.output()


async def jobs_of(url: str) -> list[uuid.UUID]:
    conn = await asyncpg.connect(url)
    try:
        return [r["job_id"] for r in await conn.fetch("SELECT job_id FROM jobs")]
    finally:
        await conn.close()


async def map_of(url: str) -> tuple[int, list[tuple[int, int]]]:
    conn = await asyncpg.connect(url)
    try:
        shard_map = await load_map(conn)
    finally:
        await conn.close()
    return shard_map.version, [(r.first, r.last) for r in shard_map.ranges]


async def create_jobs(client: httpx.AsyncClient, count: int) -> set[uuid.UUID]:
    async def create(number: int) -> uuid.UUID:
        body = {"name": f"nightly-{number}", "schedule": {"cron": "0 3 * * *"},
                "task": {"type": "http", "url": "http://127.0.0.1:9/"}}
        created = await client.post("/jobs", json=body)
        assert created.status_code == 201, created.text
        return uuid.UUID(created.json()["jobId"])

    made: set[uuid.UUID] = set()
    for start in range(0, count, 20):
        made.update(await asyncio.gather(*(create(n) for n in range(start, min(count, start + 20)))))
    return made


async def test_rebalance_proposes_then_evens_out_the_jobs_of_a_catalog_and_a_shard(
    processes: Processes, client: httpx.AsyncClient, database_url: str, shard_url: str
) -> None:
    alone = await run(processes, "alone", "rebalance")
    assert "one database holds every partition" in alone and "chimes shards add" in alone, alone

    await run(processes, "add", "add", shard_url, "--partitions", SHARD_RANGE)
    created = await create_jobs(client, JOBS)
    in_catalog, on_shard = await jobs_of(database_url), await jobs_of(shard_url)
    assert len(on_shard) < JOBS // 10  # uneven: the shard's 24 partitions hold about 2%
    before = await map_of(database_url)

    proposal = await run(processes, "proposal", "rebalance")
    proposed = MOVE_COMMAND.findall(proposal)
    assert proposed, proposal
    assert f"now:   catalog {len(in_catalog)}, shard 1 {len(on_shard)} jobs" in proposal, proposal
    assert "nothing was changed" in proposal
    assert await map_of(database_url) == before  # a proposal changes nothing
    assert (sorted(await jobs_of(database_url)), sorted(await jobs_of(shard_url))) == (
        sorted(in_catalog), sorted(on_shard))

    applied = await run(processes, "apply", "rebalance", "--apply", timeout=90)
    assert MOVE_COMMAND.findall(applied) == proposed  # the same plan, made
    assert applied.count(", done") == len(proposed), applied
    assert "rebalanced: catalog" in applied, applied

    catalog_jobs, shard_jobs = set(await jobs_of(database_url)), set(await jobs_of(shard_url))
    assert not catalog_jobs & shard_jobs  # none made twice
    assert catalog_jobs | shard_jobs == created  # none lost
    mean = JOBS / 2
    assert abs(len(catalog_jobs) - len(shard_jobs)) <= 2 * MIN_GAIN * mean, (len(catalog_jobs), len(shard_jobs))
    # Each job lives where the new map says.
    _, ranges = await map_of(database_url)
    assert shard_jobs == {j for j in created if any(first <= partition_of(j) <= last for first, last in ranges)}

    again = await run(processes, "again", "rebalance")
    assert "nothing to do" in again and not MOVE_COMMAND.search(again), again
    # Every job is still served through the API from its new home.
    for job_id in sorted(created)[:: JOBS // 12]:
        found = await client.get(f"/jobs/{job_id}")
        assert found.status_code == 200, found.text


async def test_rebalance_is_refused_while_a_move_is_under_way(
    processes: Processes, database_url: str, shard_url: str
) -> None:
    await run(processes, "add", "add", shard_url, "--partitions", SHARD_RANGE)
    mover = processes.start("move", "shards", "move", "0-9", "--to", "1", env={"CHIMES_MOVE_STOP_AT": "copying"})
    await wait_for(lambda: "stopped at copying" in mover.output(), timeout=30, what="the mover to stop")
    mover.kill()
    refused = processes.start("refused", "shards", "rebalance", "--apply")
    assert await refused.exited(timeout=30) != 0
    assert "a move is under way (move 1: partitions 0-9 catalog -> shard 1, copying" in refused.output(), \
        refused.output()
    assert "--resume, or --cancel" in refused.output()
    await run(processes, "cancel", "move", "--cancel")
    assert "nothing to do" in await run(processes, "after", "rebalance")
