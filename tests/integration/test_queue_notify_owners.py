"""The queue NOTIFY names whose runs were queued, and a worker whose share those owners hold already
does not answer it with a claim."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import asyncpg
import httpx

from chimes.store.db import open_connection
from chimes.store.working import ANY_OWNER, QUEUE_CHANNEL, queued_owners, queued_payload
from chimes.worker.worker import Worker
from tests.integration.test_fences import fired_one_off


async def first_queue_notify(database_url: str, queue: Callable[[], Awaitable[object]]) -> str:
    """The payload of the first queue NOTIFY after ``queue`` was awaited."""
    heard: asyncio.Queue[str] = asyncio.Queue()
    listener = await open_connection(database_url)
    try:
        await listener.add_listener(QUEUE_CHANNEL, lambda _c, _p, _ch, payload: heard.put_nowait(payload))
        await queue()
        return await asyncio.wait_for(heard.get(), 10)
    finally:
        await listener.close()


async def test_a_fire_names_the_owners_whose_runs_it_queued(pool: asyncpg.Pool, database_url: str) -> None:
    payload = await first_queue_notify(database_url, lambda: fired_one_off(pool))
    assert queued_owners(payload) == {"team-a"}


async def test_a_manual_run_names_its_jobs_owner(client: httpx.AsyncClient, database_url: str) -> None:
    job = (await client.post("/jobs", json={"name": "by-hand", "schedule": {"cron": "0 0 1 1 *"},
                                            "task": {"type": "http", "url": "http://127.0.0.1:9/"}})).json()

    async def run_now() -> None:
        assert (await client.post(f"/jobs/{job['jobId']}/runs")).status_code == 202

    payload = await first_queue_notify(database_url, run_now)
    assert queued_owners(payload) == {"team-a"}  # the client's


def test_a_payload_names_owners_only_when_it_knows_them_all() -> None:
    assert queued_owners(queued_payload(["b", "a", "b"])) == {"a", "b"}
    assert queued_payload(["a", None]) == ANY_OWNER  # a run whose owner the fire did not read
    assert queued_payload([f"team-{n:04}" for n in range(1000)]) == ANY_OWNER  # too many to list
    for unreadable in (ANY_OWNER, "not json", '{"owners": ["a"]}', "[1, 2]"):
        assert queued_owners(unreadable) is None  # any owner: from an older or newer scheduler, say


async def test_a_worker_claims_again_only_for_runs_of_owners_below_their_share(pool: asyncpg.Pool) -> None:
    worker = Worker(pool, "postgresql://unused")
    worker._claimer.maybe_queued = set()  # its last claim found the queue empty
    worker._claimer.refill_at = {"team-a": 20}  # team-a holds its share of the worker
    worker._claimer.queued(frozenset({"team-a"}))
    assert not worker._claimer.wake.is_set()  # a claim now would skip team-a's runs and find nothing
    assert worker._claimer.maybe_queued == {"team-a"}  # claimed as team-a's runs end
    worker._claimer.queued(frozenset({"team-a", "team-b"}))
    assert worker._claimer.wake.is_set() and worker._claimer.maybe_queued == {"team-a", "team-b"}
    worker._claimer.wake.clear()
    worker._claimer.queued(None)  # whose runs, not known
    assert worker._claimer.wake.is_set() and worker._claimer.maybe_queued is None
    worker._claimer.queued(frozenset({"team-a"}))
    assert worker._claimer.maybe_queued is None  # still not known
