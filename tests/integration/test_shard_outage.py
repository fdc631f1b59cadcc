"""One home's database stalls (its PostgreSQL SIGSTOPped, sessions open and unanswered): a worker
process's claim loop for that home must not keep the slots of the homes that still answer
(chimes.worker.budget; found by ``chimes chaos --shards``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import asyncpg
import httpx
import pytest

from chimes.store import db
from chimes.store.embedded import EmbeddedPostgres
from chimes.store.migrate import migrate
from chimes.worker.budget import SlotBudget
from chimes.worker.worker import Worker
from chimes_chaos.postgres import freeze_server
from tests.helpers import wait_for
from tests.integration.fleet import FAST_WORKER
from tests.target import Target

pytestmark = pytest.mark.own_shard_map  # databases and a shard map of its own, whatever --shards says


@pytest.fixture
async def stalling_server(tmp_path: Path) -> AsyncIterator[EmbeddedPostgres]:
    """A PostgreSQL server of this test's own (the shared ones must not be stopped)."""
    server = EmbeddedPostgres(tmp_path / "shard")
    await asyncio.to_thread(server.acquire)
    try:
        yield server
    finally:
        freeze_server(server, False)
        await asyncio.to_thread(server.release)


@pytest.mark.timeout(120)
async def test_a_stalled_home_keeps_no_slot_from_a_home_that_answers(
    client: httpx.AsyncClient, pool: asyncpg.Pool, database_url: str, stalling_server: EmbeddedPostgres,
    target: Target,
) -> None:
    shard_url = stalling_server.dsn
    await db.with_connection(shard_url, migrate)
    # No statement timeout: a claim on the stalled home waits as long as the server is stopped.
    shard_pool = await db.create_pool(shard_url, max_size=4)
    budget = SlotBudget(4)
    config = replace(FAST_WORKER, concurrency=4)
    stalled = Worker(shard_pool, shard_url, config, worker_id="w-stalled", budget=budget)
    answering = Worker(pool, database_url, config, worker_id="w-answering", budget=budget)
    tasks = [asyncio.create_task(stalled.run())]
    try:
        await wait_for(lambda: stalled.listening, timeout=20, what="the stalled home's worker to start")
        freeze_server(stalling_server)
        # Its next claim hangs, holding what it reserved; only its loop claims so far.
        await wait_for(lambda: budget.in_use > 0, timeout=20, what="a claim on the stopped server")
        assert budget.in_use <= budget.share() == 2

        body = {"name": "answering", "schedule": {"cron": "0 0 1 1 *"},
                "task": {"type": "http", "url": f"{target.url}/a"}}
        created = await client.post("/jobs", json=body)
        assert created.status_code == 201, created.text
        queued = time.monotonic()
        assert (await client.post(f"/jobs/{created.json()['jobId']}/runs")).status_code == 202
        tasks.append(asyncio.create_task(answering.run()))
        await wait_for(lambda: target.calls_to("/a"), timeout=10, what="the answering home's run to start")
        assert time.monotonic() - queued < 5
        assert budget.in_use >= 1  # the stalled claim is still waiting: it was not what let the run through
    finally:
        freeze_server(stalling_server, False)
        stalled.stop()
        answering.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        await shard_pool.close()
