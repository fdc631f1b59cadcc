"""A process that stalls inside a transaction (a GC pause, SIGSTOP, a lost network) must not keep what
its row locks guard from everyone else (found by `chimes chaos`).

A scheduler node frozen between its fire statement and the commit held its partitions' lease rows
(FOR KEY SHARE): the other nodes' takeover skips locked rows, so those partitions fired only when the
frozen node woke up, long after its lease had expired. A worker frozen inside its claim holds the
claimed runs the same way. `chimes scheduler` and `chimes worker` now have PostgreSQL end such a
session after their lease time (`db.lock_holding_limit`). The stall here is
real from the server's side: a connection opens the transaction, runs the fire statement, then
falls silent, exactly as a frozen client does.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import asyncpg
import httpx
import pytest

from chimes.settings import RUN_TIMEOUT_SEC
from chimes.store import db
from chimes.store.db import DB_ERRORS
from chimes.store.queries import query, sql
from chimes.store.scheduling import SchedulerStore
from chimes.store.working import WorkerStore
from tests.helpers import wait_for
from tests.integration.fleet import Fleet
from tests.target import Target

TTL = 2.0
PARTITION = 5


async def stall_inside_a_fire(conn: asyncpg.Connection, token: int) -> None:
    """Open a transaction and run the fire statement for PARTITION (no triggers due: it only takes the
    lease lock), then send nothing more."""
    await conn.execute("BEGIN")
    fire = query("fire_triggers")
    arrays = {name: [] for name in fire.names if name.startswith(("trigger_", "slot_", "counted_"))}
    row = await conn.fetchrow(fire.text, *fire.args({  # fired at its time, not ahead
        "held_partition_id": [PARTITION], "held_token": [token], "node_id": "node-a", "fired_at": datetime.now(UTC),
        "ahead_sec": 0.0, **arrays}))
    assert row["leases_held"] == 1


async def test_partitions_of_a_node_stalled_inside_a_fire_are_taken_over(database_url: str,
                                                                         pool: asyncpg.Pool) -> None:
    stalled_pool = await db.create_pool(database_url, min_size=1, max_size=1,
                                        server_settings=db.lock_holding_limit(TTL))
    try:
        node_a = SchedulerStore(stalled_pool, "node-a")
        held = (await node_a.sync_leases("host-a", 1, {}, TTL)).held
        assert PARTITION in held
        conn = await stalled_pool.acquire()
        await stall_inside_a_fire(conn, held[PARTITION])
        stalled_at = time.monotonic()

        node_b = SchedulerStore(pool, "node-b")
        owned: dict[int, int] = {}

        async def takes_over() -> bool:
            owned.update((await node_b.sync_leases("host-b", 2, owned, TTL)).held)
            return PARTITION in owned

        await wait_for(takes_over, timeout=TTL + 6, what="node-b to take the stalled node's partition",
                       interval=0.5)
        # The lease expired TTL after node-a's last renewal; the session ended TTL after it fell silent.
        assert time.monotonic() - stalled_at < TTL + 4
        with pytest.raises(DB_ERRORS):  # node-a wakes up: its transaction is gone, nothing it held survived
            await conn.execute("COMMIT")
        await stalled_pool.release(conn)
    finally:
        stalled_pool.terminate()


async def test_runs_claimed_by_a_worker_stalled_inside_its_claim_are_started_by_another(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, database_url: str, pool: asyncpg.Pool
) -> None:
    fleet.worker.stop()  # the fleet's node fires; the two workers below do the claiming
    await wait_for(lambda: _no_workers(pool), timeout=10, what="the fleet's worker to stop")
    at = datetime.now(UTC).isoformat()
    response = await client.post("/jobs", json={"name": "stalled-claim", "schedule": {"at": at},
                                                "task": {"type": "http", "url": f"{target.url}/claimed"}})
    assert response.status_code == 201, response.text
    await wait_for(lambda: pool.fetchval("SELECT count(*) FROM run_queue"), timeout=10, what="the run to be queued")
    stalled_pool = await db.create_pool(database_url, min_size=1, max_size=1,
                                        server_settings=db.lock_holding_limit(TTL))
    try:
        conn = await stalled_pool.acquire()
        # As the claim of a worker whose claims begin a transaction (one of an earlier release, or one
        # with no claims connection: WorkerStore.claim), which then falls silent before the commit.
        await conn.execute(sql("begin_by_key"))
        [claimed] = await conn.fetch(sql("claim_runs"), 10, "worker-a", TTL, 1.0, 0, 2, RUN_TIMEOUT_SEC, [])
        stalled_at = time.monotonic()
        worker_b = WorkerStore(pool, "worker-b")
        [run] = await wait_for(lambda: worker_b.claim(10, TTL, 1.0), timeout=TTL + 6,
                               what="another worker to claim the stalled worker's run", interval=0.5)
        assert run.run_id == claimed["run_id"]
        assert time.monotonic() - stalled_at < TTL + 4
        with pytest.raises(DB_ERRORS):
            await conn.execute("COMMIT")
        await stalled_pool.release(conn)
    finally:
        stalled_pool.terminate()


async def _no_workers(pool: asyncpg.Pool) -> bool:
    return await pool.fetchval("SELECT count(*) FROM workers") == 0
