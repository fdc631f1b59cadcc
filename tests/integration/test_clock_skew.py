"""A scheduler node whose clock runs ahead fires nothing before its time, and follows the database's.

Clocks of different hosts drift (a zone whose NTP servers are gone, a VM after a pause). The
database's clock decides whether a trigger's time has come (fire_triggers), whatever the node
believes. The node measures its offset from that clock and sends each fire when the database's clock
reaches it (chimes.scheduler.database_clock), so that the database has nothing to refuse. The node
here is given a clock 2 s fast, the way a host's would be; once it follows its host's clock as it is,
to show the database's own fence, and once the database's, as it does by default.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx

from chimes.clock import Clock
from chimes.scheduler.node import SchedulerConfig, SchedulerNode
from chimes.worker.worker import Worker
from tests.helpers import wait_for
from tests.integration.fleet import FAST_SCHEDULER, FAST_WORKER
from tests.integration.test_core_loop import _finished, http_job
from tests.target import Target

AHEAD_SEC = 2.0


async def test_the_database_refuses_what_a_fast_node_sends_early(
    pool: asyncpg.Pool, database_url: str, client: httpx.AsyncClient, target: Target
) -> None:
    config = replace(FAST_SCHEDULER, follow_database_clock=False)
    node = await _run_one_offs(pool, database_url, client, target, config)
    assert node.stats.too_early >= 3, "the fast node's fires should have reached the database early"


async def test_a_fast_node_follows_the_database_clock(
    pool: asyncpg.Pool, database_url: str, client: httpx.AsyncClient, target: Target
) -> None:
    node = await _run_one_offs(pool, database_url, client, target, FAST_SCHEDULER)
    assert -AHEAD_SEC - 0.1 < node.clock.offset_sec <= -AHEAD_SEC + 0.1
    assert node.stats.too_early == 0, "a node that follows the database's clock sends nothing early"


async def _run_one_offs(pool: asyncpg.Pool, database_url: str, client: httpx.AsyncClient, target: Target,
                        config: SchedulerConfig) -> SchedulerNode:
    """Three one-off jobs run by a node whose host clock is 2 s fast; none may be delivered early."""
    node = SchedulerNode(pool, config, node_id="fast-node", clock=Clock(offset_sec=AHEAD_SEC))
    worker = Worker(pool, database_url, FAST_WORKER, worker_id="worker")
    tasks = [asyncio.create_task(node.run()), asyncio.create_task(worker.run())]
    try:
        slots = [datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=4 + i) for i in range(3)]
        jobs = [(await client.post("/jobs", json=http_job(target, f"/once-{i}", {"at": slot.isoformat()}))).json()
                for i, slot in enumerate(slots)]
        for job in jobs:
            await wait_for(lambda job=job: _finished(client, job["jobId"]), timeout=20, what="the one-off runs")
    finally:
        node.stop()
        worker.stop()
        for task in tasks:
            await task
    for i, slot in enumerate(slots):
        [call] = target.calls_to(f"/once-{i}")
        assert call.received_at >= slot.timestamp(), f"delivered {slot.timestamp() - call.received_at:.2f} s early"
    assert node.stats.fired == 3
    return node
