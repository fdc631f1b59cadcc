"""A scheduler node and a worker running in the test's event loop, tuned for quick tests.

With a shard map (``pytest --shards N``) the fleet is what `chimes scheduler` and `chimes worker`
run: a node and a claim loop per home (the catalog first), the claim loops sharing the worker's
concurrency, owners and signing secrets read from the catalog."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import asyncpg
import pytest

from chimes.scheduler.leases import LeaseConfig
from chimes.scheduler.node import SchedulerConfig, SchedulerNode
from chimes.services.owners import SigningSecrets
from chimes.worker.budget import SlotBudget
from chimes.worker.guard import TaskGuard
from chimes.worker.worker import Worker, WorkerConfig
from tests.helpers import Homes

FAST_SCHEDULER = SchedulerConfig(
    lease=LeaseConfig(ttl_sec=3.0, renew_every_sec=0.5), lookahead_sec=3.0, scan_every_sec=0.3, reap_every_sec=0.5,
)
FAST_WORKER = WorkerConfig(concurrency=20, lease_sec=3.0, heartbeat_every_sec=0.5, poll_every_sec=0.3,
                           shutdown_grace_sec=2.0, deadline_grace_sec=1.0)


@dataclass
class Fleet:
    node: SchedulerNode  # the catalog's
    worker: Worker
    nodes: list[SchedulerNode] = field(default_factory=list)  # one per home, the catalog's first
    workers: list[Worker] = field(default_factory=list)


@pytest.fixture
async def fleet(pool: asyncpg.Pool, database_url: str, homes: Homes) -> AsyncIterator[Fleet]:
    home_pools = await homes.homes()
    urls = [database_url, *homes.map.urls()]
    if len(home_pools) == 1:
        nodes = [SchedulerNode(pool, FAST_SCHEDULER, node_id="test-node")]
        workers = [Worker(pool, database_url, FAST_WORKER, worker_id="test-worker")]
    else:  # as cli/roles.py runs them
        secrets, guard = SigningSecrets(pool), TaskGuard(pool, allow_commands=FAST_WORKER.allow_commands)
        budget = SlotBudget(FAST_WORKER.concurrency)
        nodes = [SchedulerNode(home, FAST_SCHEDULER, node_id="test-node", signing_secrets=secrets)
                 for home in home_pools]
        workers = [Worker(home, url, FAST_WORKER, worker_id="test-worker", guard=guard, budget=budget)
                   for home, url in zip(home_pools, urls, strict=True)]
    tasks = [asyncio.create_task(member.run()) for member in [*nodes, *workers]]
    yield Fleet(nodes[0], workers[0], nodes, workers)
    for member in [*nodes, *workers]:
        member.stop()
    for task in tasks:
        await task
