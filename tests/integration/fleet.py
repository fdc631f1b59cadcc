"""A scheduler node and a worker running in the test's event loop, tuned for quick tests.

With a shard map (``pytest --shards N``) the fleet is what `chimes scheduler` and `chimes worker`
run: a node and a claim loop per home (the catalog first), the claim loops sharing the worker's
concurrency, owners and signing secrets read from the catalog."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import asyncpg
import pytest

from chimes.scheduler.calendar_book import CalendarBook
from chimes.scheduler.leases import LeaseConfig
from chimes.scheduler.node import SchedulerConfig, SchedulerNode
from chimes.security.ssrf import EgressPolicy
from chimes.services.owners import SigningSecrets
from chimes.store.cap_slots import CapSlots
from chimes.worker.budget import SlotBudget
from chimes.worker.guard import TaskGuard
from chimes.worker.tasks.dispatch import Executors
from chimes.worker.worker import Worker, WorkerConfig
from tests.helpers import Homes

FAST_SCHEDULER = SchedulerConfig(
    lease=LeaseConfig(ttl_sec=3.0, renew_every_sec=0.5), lookahead_sec=3.0, scan_every_sec=0.3, reap_every_sec=0.5,
)
FAST_WORKER = WorkerConfig(concurrency=20, lease_sec=3.0, heartbeat_every_sec=0.5, poll_every_sec=0.3,
                           shutdown_grace_sec=2.0, deadline_grace_sec=1.0)


@dataclass
class Fleet:
    nodes: list[SchedulerNode]  # one per home, the catalog's first
    workers: list[Worker]

    @property
    def node(self) -> SchedulerNode:
        """The catalog's node (the only one with one database)."""
        return self.nodes[0]

    @property
    def worker(self) -> Worker:
        """The catalog's claim loop (the only one with one database)."""
        return self.workers[0]

    def running(self) -> set[uuid.UUID]:
        """The runs the worker is running now, from every home."""
        return {run_id for worker in self.workers for run_id in worker._running}

    def listening(self) -> bool:
        return all(worker.listening for worker in self.workers)


@contextlib.asynccontextmanager
async def running_fleet(pool: asyncpg.Pool, database_url: str, homes: Homes, *,
                        scheduler: SchedulerConfig | None = FAST_SCHEDULER, worker: WorkerConfig | None = FAST_WORKER,
                        node_id: str = "test-node", worker_id: str = "test-worker",
                        executors: Callable[[], Executors] | None = None, egress: EgressPolicy | None = None,
                        guard: TaskGuard | None = None) -> AsyncIterator[Fleet]:
    """A node (unless ``scheduler`` is None) and a worker (unless ``worker`` is None) on every home of
    the test's map, as cli/roles.py runs them; ``executors`` makes each claim loop's own."""
    home_pools = await homes.homes()
    urls = [database_url, *homes.map.urls()]
    secrets = SigningSecrets(pool)
    sharded = len(home_pools) > 1
    serves: list[frozenset[int] | None] = [held for _, held in homes.map.homes()] if sharded else [None]
    shard_ids = [None, *dict.fromkeys(r.shard_id for r in homes.map.ranges)]
    nodes = [] if scheduler is None else [
        SchedulerNode(home, scheduler, node_id=node_id, egress=egress, serves=held,
                      signing_secrets=secrets if sharded else None, calendars=CalendarBook(pool), listen_dsn=url)
        for home, held, url in zip(home_pools, serves, urls, strict=True)]
    workers = []
    if worker is not None:
        shared = guard or (TaskGuard(pool, allow_commands=worker.allow_commands) if sharded else None)
        budget = SlotBudget(worker.concurrency) if sharded else None
        cap_slots = CapSlots(pool) if sharded else None  # caps across shards: slots in the catalog
        workers = [Worker(home, url, worker, worker_id=worker_id, guard=shared, budget=budget,
                          executors=executors() if executors else None, cap_slots=cap_slots, shard_id=shard_id)
                   for home, url, shard_id in zip(home_pools, urls, shard_ids, strict=True)]
    tasks = [asyncio.create_task(member.run()) for member in [*nodes, *workers]]
    try:
        yield Fleet(nodes, workers)
    finally:
        for member in [*nodes, *workers]:
            member.stop()
        for task in tasks:
            await task


@pytest.fixture
async def fleet(pool: asyncpg.Pool, database_url: str, homes: Homes) -> AsyncIterator[Fleet]:
    async with running_fleet(pool, database_url, homes) as running:
        yield running
