"""A scheduler node and a worker running in the test's event loop, tuned for quick tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
import pytest

from chimes.scheduler.leases import LeaseConfig
from chimes.scheduler.node import SchedulerConfig, SchedulerNode
from chimes.worker.worker import Worker, WorkerConfig

FAST_SCHEDULER = SchedulerConfig(
    lease=LeaseConfig(ttl_sec=3.0, renew_every_sec=0.5), lookahead_sec=3.0, scan_every_sec=0.3, reap_every_sec=0.5,
)
FAST_WORKER = WorkerConfig(concurrency=20, lease_sec=3.0, heartbeat_every_sec=0.5, poll_every_sec=0.3,
                           shutdown_grace_sec=2.0, deadline_grace_sec=1.0)


@dataclass
class Fleet:
    node: SchedulerNode
    worker: Worker


@pytest.fixture
async def fleet(pool: asyncpg.Pool, database_url: str) -> AsyncIterator[Fleet]:
    node = SchedulerNode(pool, FAST_SCHEDULER, node_id="test-node")
    worker = Worker(pool, database_url, FAST_WORKER, worker_id="test-worker")
    tasks = [asyncio.create_task(node.run()), asyncio.create_task(worker.run())]
    yield Fleet(node, worker)
    node.stop()
    worker.stop()
    for task in tasks:
        await task
