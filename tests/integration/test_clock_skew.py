"""A scheduler node whose clock runs ahead fires nothing before its time.

Clocks of different hosts drift (a zone whose NTP servers are gone, a VM after a pause). The node
decides when to send a fire by its own clock; the database's clock decides whether the trigger's time
has come (fire_triggers). The node here is given a clock 2 s fast, the way a host's would be.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx

from chimes.clock import Clock
from chimes.scheduler.node import SchedulerNode
from chimes.worker.worker import Worker
from tests.helpers import wait_for
from tests.integration.fleet import FAST_SCHEDULER, FAST_WORKER
from tests.integration.test_core_loop import _finished, http_job
from tests.target import Target

AHEAD_SEC = 2.0


async def test_a_node_with_a_fast_clock_fires_nothing_early(
    pool: asyncpg.Pool, database_url: str, client: httpx.AsyncClient, target: Target
) -> None:
    node = SchedulerNode(pool, FAST_SCHEDULER, node_id="fast-node", clock=Clock(offset_sec=AHEAD_SEC))
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
