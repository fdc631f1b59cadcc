"""A run cap after a long outage, and a catch-up too large to plan in one go: the cap counts every
slot the catch-up went through, and the node's loop keeps renewing its leases while it plans.

Real PostgreSQL and a real scheduler node; an outage is the job's trigger moved back in time.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

import asyncpg
import httpx

from chimes.scheduler.health import HealthCheck
from chimes.scheduler.node import SchedulerNode
from chimes.slots import MAX_RECORDED, MAX_WALK
from tests.helpers import Homes, wait_for
from tests.integration.fleet import FAST_SCHEDULER
from tests.integration.test_semantics import job
from tests.target import Target


async def _behind(pool: asyncpg.Pool, job_id: str, seconds: int) -> None:
    """The scheduler was down: the job's trigger is left ``seconds`` behind, on a whole second."""
    await pool.execute("UPDATE triggers SET fire_at = date_trunc('second', now()) - make_interval(secs => $2) "
                       "WHERE job_id = $1", uuid.UUID(job_id), seconds)


async def _slots_counted(pool: asyncpg.Pool, job_id: str, at_least: int) -> bool:
    counted = await pool.fetchval("SELECT slots_fired FROM job_slot_counts WHERE job_id = $1", uuid.UUID(job_id))
    return counted is not None and counted >= at_least


async def test_a_run_cap_counts_the_slots_an_outage_left_unrecorded(
    client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    """maxRuns 1,500, 1,800 slots missed: the catch-up records the newest 1,000 of the 1,500 the job had
    left, counts all 1,500, and the job has ended: no runs left, no next run, and no stalled-schedule
    alert for a schedule that simply ended."""
    created = await client.post("/jobs", json=job(target, "/capped", {"cron": "* * * * * *", "maxRuns": 1500},
                                                  concurrency="allow", catchUp={"policy": "none"}))
    assert created.status_code == 201, created.text
    job_id = created.json()["jobId"]
    pool = await homes.for_job(job_id)
    await _behind(pool, job_id, 1800)
    node = SchedulerNode(pool, FAST_SCHEDULER, node_id="after-the-outage")
    running = asyncio.create_task(node.run())
    try:
        await wait_for(lambda: _slots_counted(pool, job_id, 1), timeout=30, what="the catch-up")
    finally:
        node.stop()
        await running
    assert await pool.fetchval("SELECT count(*) FROM runs WHERE job_id = $1", uuid.UUID(job_id)) == MAX_RECORDED
    oldest = await pool.fetchval("SELECT reason FROM runs WHERE job_id = $1 ORDER BY scheduled_at LIMIT 1",
                                 uuid.UUID(job_id))
    assert "500 earlier missed fires are not recorded one by one" in oldest
    shown = (await client.get(f"/jobs/{job_id}")).json()
    assert (shown["remainingRuns"], shown["scheduleEnded"], shown["nextRunAt"]) == (0, True, None)
    await HealthCheck(pool).sweep(await pool.fetchval("SELECT now()"))
    assert await pool.fetchval("SELECT count(*) FROM schedule_stalls WHERE job_id = $1", uuid.UUID(job_id)) == 0


async def test_a_huge_capped_catch_up_is_planned_in_parts_off_the_nodes_loop(
    client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    """An every-second job with a cap of a million, its scheduler gone for three and a half days: each
    fire walks at most MAX_WALK slots, in a thread, and the node's loop meanwhile keeps its pace (its
    leases, whose time to live is shorter than such a walk on the loop, are never lost)."""
    created = await client.post("/jobs", json=job(target, "/million", {"cron": "* * * * * *", "maxRuns": 1_000_000},
                                                  concurrency="allow", catchUp={"policy": "none"}))
    job_id = created.json()["jobId"]
    pool = await homes.for_job(job_id)
    await _behind(pool, job_id, int(timedelta(days=3.5).total_seconds()))
    node = SchedulerNode(pool, FAST_SCHEDULER, node_id="long-gone")
    running = asyncio.create_task(node.run())
    loop = asyncio.get_running_loop()
    gaps: list[float] = []

    async def pace() -> None:
        last = loop.time()
        while True:
            await asyncio.sleep(0.01)
            gaps.append(loop.time() - last)
            last = loop.time()

    probe = asyncio.create_task(pace())
    lost: list[set[int]] = []
    drop = node.leases._on_lost  # what the node does when it loses partitions: noted as well

    def on_lost(partitions: set[int]) -> None:
        lost.append(partitions)
        drop(partitions)

    node.leases._on_lost = on_lost
    try:
        await wait_for(lambda: _slots_counted(pool, job_id, 2 * MAX_WALK), timeout=90, what="two parts of the walk")
    finally:
        probe.cancel()
        node.stop()
        await running
    counted = await pool.fetchval("SELECT slots_fired FROM job_slot_counts WHERE job_id = $1", uuid.UUID(job_id))
    behind = timedelta(days=3.5).total_seconds()
    assert counted % MAX_WALK == 0 or counted >= behind, "each fire walked MAX_WALK slots and went on from there"
    assert lost == []
    assert max(gaps) < 0.5, f"the node's loop stalled for {max(gaps):.2f}s"
