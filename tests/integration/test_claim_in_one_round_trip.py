"""A worker's claim in one round trip (migration 0022), and the queue NOTIFY that names whose runs were
queued, which a worker whose share those owners hold already does not answer with a claim."""

from __future__ import annotations

import asyncio
import re

import asyncpg

from chimes.store.db import open_connection
from chimes.store.queries import sql
from chimes.store.working import ANY_OWNER, QUEUE_CHANNEL, WorkerStore, queued_owners, queued_payload
from chimes.worker.worker import Worker
from tests.integration.test_fences import fired_one_off


def _words(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


async def test_the_claim_function_runs_working_sqls_claim_runs_word_for_word(pool: asyncpg.Pool) -> None:
    # The function's query is a copy; this keeps the copy from drifting from the statement the
    # capped and shard claims still run (a change to claim_runs needs a migration of the function).
    body = await pool.fetchval("SELECT prosrc FROM pg_proc WHERE proname = 'chimes_claim_runs'")
    assert body is not None, "migration 0022 did not make chimes_claim_runs"
    assert _words(sql("claim_runs").rstrip().rstrip(";")) in _words(body)


async def test_the_claim_function_claims_as_claim_runs_does_with_the_planner_settings(pool: asyncpg.Pool) -> None:
    _, _, job_id = await fired_one_off(pool)
    store = WorkerStore(pool, "worker-1")
    assert await store.claim(10, 30, 30, skip_owners=["team-a"]) == []  # its owner holds its share
    [run] = await store.claim(10, 30, 30)
    assert run.job_id == job_id and run.owner == "team-a" and run.attempt == 1
    row = await pool.fetchrow("SELECT status, worker_id, lease_token FROM runs WHERE run_id = $1", run.run_id)
    assert (row["status"], row["worker_id"], row["lease_token"]) == ("running", "worker-1", run.lease_token)
    assert await pool.fetchval("SELECT count(*) FROM claim_leases WHERE token = $1", run.lease_token) == 1
    assert await store.claim(10, 30, 30) == []
    # The settings were the function's own: the session's are as they were.
    assert await pool.fetchval("SHOW enable_seqscan") == "on"


async def test_a_fire_names_the_owners_whose_runs_it_queued(pool: asyncpg.Pool, database_url: str) -> None:
    heard: asyncio.Queue[str] = asyncio.Queue()
    listener = await open_connection(database_url)
    try:
        await listener.add_listener(QUEUE_CHANNEL, lambda _c, _p, _ch, payload: heard.put_nowait(payload))
        await fired_one_off(pool)
        payload = await asyncio.wait_for(heard.get(), 10)
    finally:
        await listener.close()
    assert queued_owners(payload) == {"team-a"}


def test_a_payload_names_owners_only_when_it_knows_them_all() -> None:
    assert queued_owners(queued_payload(["b", "a", "b"])) == {"a", "b"}
    assert queued_payload(["a", None]) == ANY_OWNER  # a run whose owner the fire did not read
    assert queued_payload([f"team-{n:04}" for n in range(1000)]) == ANY_OWNER  # too many to list
    for unreadable in (ANY_OWNER, "not json", '{"owners": ["a"]}', "[1, 2]"):
        assert queued_owners(unreadable) is None  # any owner: from an older or newer scheduler, say


async def test_a_worker_claims_again_only_for_runs_of_owners_below_their_share(pool: asyncpg.Pool) -> None:
    worker = Worker(pool, "postgresql://unused")
    worker._others_drained = True  # its last claim found nothing but the runs of owners at their share
    worker._refill_at = {"team-a": 20}
    worker._queued(frozenset({"team-a"}))
    assert not worker._wake.is_set()  # a claim now would skip team-a's runs and find nothing
    worker._queued(frozenset({"team-a", "team-b"}))
    assert worker._wake.is_set() and not worker._others_drained
    worker._wake.clear()
    worker._others_drained = True
    worker._queued(None)  # whose runs, not known
    assert worker._wake.is_set()
