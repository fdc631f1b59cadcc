"""Partitions change hands without waiting for a lease round or for a lease to expire.

- A node that stops gives back every partition the database says it owns, even when the stop cut a
  lease round short: that round neither makes it forget what it holds (it still fires the slot under
  way) nor hides partitions it took.
- Partitions another node gives up (a node joined, and the others shed their extra share) are read
  by the node that takes them at once, not at its next scan, and those it could not take yet, because
  the giving node's last batch still held them, are asked for again a tenth of a second later, not at
  its next lease round.

Either way a slot due just after the hand-over would otherwise fire late, and under
`concurrency: skip` the slot after it would find it still running. A real node (``SchedulerNode``)
takes the partitions; the node that gives them up is its store, driven round by round. The taking
node's scans are a minute apart, so that only the read of what it gained can find the trigger."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import asyncpg
import pytest

from chimes.ids import partition_of
from chimes.scheduler.node import SchedulerNode
from chimes.store.scheduling import SchedulerStore
from chimes.timeouts import wait_event
from tests.helpers import wait_for
from tests.integration.fleet import FAST_SCHEDULER
from tests.integration.test_busy_fleet import fire_held_mid_statement
from tests.integration.test_fencing import make_due_job, take_all

SCANS_RARELY = replace(FAST_SCHEDULER, scan_every_sec=60.0)


async def _job_in_the_half_given_up(pool: asyncpg.Pool) -> uuid.UUID:
    """A due job in partitions 512-1023: those a node holding all 1,024 gives up to a second node."""
    while partition_of(job_id := await make_due_job(pool)) < 512:
        await pool.execute("DELETE FROM triggers WHERE job_id = $1", job_id)
        await pool.execute("DELETE FROM jobs WHERE job_id = $1", job_id)
    return job_id


@pytest.fixture
async def giving(pool: asyncpg.Pool) -> tuple[SchedulerStore, dict[int, int]]:
    """A node holding every partition, with their tokens."""
    store = SchedulerStore(pool, "node-giving")
    held = await take_all(store)
    assert len(held) == 1024
    return store, held


@pytest.fixture
async def joining(pool: asyncpg.Pool, giving: tuple[SchedulerStore, dict[int, int]]) -> AsyncIterator[SchedulerNode]:
    """A node that has joined (it is alive) but holds nothing yet, and has read nothing."""
    node = SchedulerNode(pool, SCANS_RARELY, node_id="node-joining")
    await node._sync_leases()
    assert not node.leases.held
    yield node
    for task in node._reads:
        task.cancel()
    await asyncio.gather(*node._reads, return_exceptions=True)
    await node.leases.release_all()


async def test_a_joining_node_reads_the_partitions_it_is_given_at_once(
    pool: asyncpg.Pool, giving: tuple[SchedulerStore, dict[int, int]], joining: SchedulerNode
) -> None:
    job_id = await _job_in_the_half_given_up(pool)
    store, held = giving
    assert len((await store.sync_leases("host", 1, held, ttl_sec=30)).held) == 512  # half to the new node
    await joining._sync_leases()
    assert len(joining.leases.held) == 512 and not joining.leases.short
    await asyncio.gather(*joining._reads)
    assert joining._held_until is not None
    assert [t.job_id for t in joining.wheel.pop_due(float("inf"))] == [job_id]


async def test_a_partition_still_locked_by_the_giving_nodes_batch_is_taken_when_it_ends(
    pool: asyncpg.Pool, giving: tuple[SchedulerStore, dict[int, int]], joining: SchedulerNode
) -> None:
    job_id = await _job_in_the_half_given_up(pool)
    store, held = giving
    async with fire_held_mid_statement(pool, store, held, job_id) as firing:
        assert len((await store.sync_leases("host", 1, held, ttl_sec=30)).held) == 512
        await joining._sync_leases()
        assert partition_of(job_id) not in joining.leases.held
        assert len(joining.leases.held) == 511 and joining.leases.short
    assert (await firing).fired == 1
    # Asked again well before the next lease round (renew_every_sec), it takes the partition.
    assert await wait_event(joining._leases_changed, SCANS_RARELY.lease.renew_every_sec / 2)
    await joining._sync_leases()
    assert partition_of(job_id) in joining.leases.held and not joining.leases.short


async def _free(pool: asyncpg.Pool) -> int:
    return await pool.fetchval("SELECT count(*) FROM partition_leases WHERE owner IS NULL")


async def test_a_node_stopped_in_the_middle_of_a_lease_round_still_hands_every_partition_over(
    pool: asyncpg.Pool
) -> None:
    node = SchedulerNode(pool, SCANS_RARELY, node_id="node-stopping")
    await node._sync_leases()
    assert len(node.leases.held) == 1024
    async with pool.acquire() as holder, holder.transaction():  # the round waits on its heartbeat row
        await holder.execute("SELECT 1 FROM scheduler_nodes WHERE node_id = 'node-stopping' FOR UPDATE")
        round_ = asyncio.create_task(node._sync_leases())
        await wait_for(lambda: _waiting_on_a_lock(pool), timeout=10, what="the lease round to wait")
        round_.cancel()  # as the node's stop cancels its lease loop
        with pytest.raises(asyncio.CancelledError):
            await round_
    assert len(node.leases.held) == 1024  # still fired until handed over
    await node.leases.release_all()
    assert await _free(pool) == 1024


async def test_a_leaving_node_gives_back_partitions_it_never_heard_back_about(pool: asyncpg.Pool) -> None:
    store = SchedulerStore(pool, "node-leaving")
    await take_all(store)  # a round that committed, its answer lost with the stop
    await store.leave()
    assert await _free(pool) == 1024


async def _waiting_on_a_lock(pool: asyncpg.Pool) -> bool:
    return await pool.fetchval("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                               "AND wait_event_type = 'Lock'") > 0
