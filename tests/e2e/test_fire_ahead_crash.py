"""A scheduler node SIGKILLed while a burst it fired ahead waits for its instant loses no run.

`chimes scheduler` fires an instant of at least 500 triggers ahead of it and commits each batch at
the instant (SchedulerStore.fire_ahead). Killed in between, its open transactions end with its
connections: nothing they wrote was ever seen, the triggers are still there, and the node that takes
the partitions over fires every one of them, once.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx
import pytest

from tests.e2e.processes import Processes
from tests.helpers import wait_for
from tests.target import Target

# One node's transactions on one database: on shards a burst this size splits under the minimum per
# home, and the firing path is the same on each home.
pytestmark = [pytest.mark.single_database("about one node's transactions on one database"), pytest.mark.long]

BURST = 600  # over the node's fire_ahead_min of 500: the instant is fired ahead
LANES = 8  # requests in flight while the jobs are created
WAITING = ("SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' "
           "AND query LIKE '%pg_notify(''chimes_run_queue''%'")


async def test_a_node_killed_while_its_burst_waits_for_its_instant_loses_no_run(
    processes: Processes, pool: asyncpg.Pool, client: httpx.AsyncClient, target: Target
) -> None:
    instant = (datetime.now(UTC) + timedelta(seconds=20)).replace(microsecond=0)

    async def create(lane: int) -> None:
        for i in range(lane, BURST, LANES):
            created = await client.post("/jobs", json={"name": f"burst-{i}", "schedule": {"at": instant.isoformat()},
                                                       "task": {"type": "http", "url": f"{target.url}/burst/{i}"}})
            assert created.status_code == 201, created.text

    await asyncio.gather(*(create(lane) for lane in range(LANES)))
    assert datetime.now(UTC) < instant - timedelta(seconds=5), "the jobs took too long to create"
    doomed = processes.scheduler("node-1", lease_ttl=3)
    await wait_for(lambda: pool.fetchval(WAITING), timeout=30, what="a batch fired ahead, waiting for its instant")
    assert await pool.fetchval("SELECT clock_timestamp()") < instant
    doomed.kill()
    assert await pool.fetchval("SELECT count(*) FROM runs") == 0, "a run of the killed node's batches was seen"
    processes.scheduler("node-2", lease_ttl=3)
    await wait_for(lambda: _runs_made(pool, BURST), timeout=40, what="the other node to fire every trigger")
    rows = await pool.fetch("SELECT job_id, count(*) AS runs, min(scheduled_at) AS at FROM runs GROUP BY job_id")
    assert len(rows) == BURST
    assert {r["runs"] for r in rows} == {1}, "a slot made two runs"
    assert {r["at"] for r in rows} == {instant}
    assert await pool.fetchval("SELECT count(*) FROM triggers WHERE job_id = ANY($1::uuid[])",
                               [uuid.UUID(str(r["job_id"])) for r in rows]) == 0


async def _runs_made(pool: asyncpg.Pool, count: int) -> bool:
    return bool(await pool.fetchval("SELECT count(*) FROM runs") >= count)
