"""What a burst exposed: while fires are in flight a node still renews its leases, a takeover still
waits for them, a worker's heartbeat never stops a run it claimed while the heartbeat ran, and
triggers due a few milliseconds apart are fired in one batch, not one statement each."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from chimes.ids import partition_of
from chimes.scheduler.firing import plan_fires
from chimes.scheduler.node import SchedulerNode
from chimes.services.jobs import JobService
from chimes.store.scheduling import FireResult, SchedulerStore
from chimes.store.working import ClaimedRun
from chimes.worker.worker import Worker, WorkerConfig
from tests.helpers import wait_for
from tests.integration.fleet import FAST_SCHEDULER
from tests.integration.test_fencing import due, fire_due_one_offs, make_due_job, spec, stall, take_all

FIRE_WAITING = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%One batch of due triggers%'
"""


@contextlib.asynccontextmanager
async def fire_held_mid_statement(pool: asyncpg.Pool, store: SchedulerStore, leases: dict[int, int],
                                  job_id: object) -> AsyncIterator[asyncio.Task]:
    """A batch in flight: it has checked (and locked) its leases, then waits on a trigger row that
    another transaction holds, until the block ends."""
    async with pool.acquire() as holder:
        transaction = holder.transaction()
        await transaction.start()
        await holder.execute("SELECT 1 FROM triggers WHERE job_id = $1 FOR UPDATE", job_id)
        triggers = await due(store, leases)
        firing = asyncio.create_task(store.fire(leases, plan_fires(triggers), datetime.now(UTC)))
        await wait_for(lambda: _fire_waiting(pool), timeout=10, what="the batch to wait mid-statement")
        try:
            yield firing
        finally:
            await transaction.rollback()


async def _fire_waiting(pool: asyncpg.Pool) -> bool:
    return await pool.fetchval(FIRE_WAITING) == 1


async def test_lease_renewal_does_not_wait_for_a_fire_in_flight(pool: asyncpg.Pool) -> None:
    job_id = await make_due_job(pool)
    store = SchedulerStore(pool, "node")
    leases = await take_all(store)
    async with fire_held_mid_statement(pool, store, leases, job_id) as firing:
        renewed = (await asyncio.wait_for(store.sync_leases("host", 1, leases, ttl_sec=30), timeout=10)).held
        assert renewed == leases
    assert (await firing).fired == 1


async def test_takeover_skips_a_partition_while_its_fire_is_in_flight(pool: asyncpg.Pool) -> None:
    job_id = await make_due_job(pool)
    old = SchedulerStore(pool, "node-old")
    old_leases = await take_all(old)
    partition = partition_of(job_id)
    new = SchedulerStore(pool, "node-new")
    async with fire_held_mid_statement(pool, old, old_leases, job_id) as firing:
        await asyncio.wait_for(stall(pool, "node-old"), timeout=10)
        taken = await asyncio.wait_for(take_all(new), timeout=10)
        assert partition not in taken and len(taken) == 1023
    assert (await firing).fired == 1  # checked against the lease it still held when it started
    taken = (await new.sync_leases("host", 1, taken, ttl_sec=30)).held
    assert taken[partition] == old_leases[partition] + 1


async def test_heartbeat_keeps_a_run_claimed_while_it_waited(pool: asyncpg.Pool, database_url: str) -> None:
    await fire_due_one_offs(pool, 2)
    worker = Worker(pool, database_url, WorkerConfig(), worker_id="worker")
    never = asyncio.Event()

    def start(run: ClaimedRun) -> None:  # as the claim loop does, with a task that runs until stopped
        worker._running[run.run_id] = (run, asyncio.create_task(never.wait()))

    [first] = await worker.store.claim(1, 30, 30)
    start(first)
    extend = worker.store.extend_leases

    async def extend_while_claiming(runs: list[ClaimedRun], lease_sec: float) -> set:
        held = await extend(runs, lease_sec)
        [second] = await worker.store.claim(1, 30, 30)  # the claim loop ran while the heartbeat waited
        start(second)
        return held

    worker.store.extend_leases = extend_while_claiming  # type: ignore[method-assign]
    await worker._heartbeat.beat()
    tasks = [task for _, task in worker._running.values()]
    try:
        assert len(tasks) == 2 and not any(task.cancelling() for task in tasks)
        await asyncio.sleep(0.1)
        assert not any(task.done() for task in tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_triggers_due_milliseconds_apart_fire_in_one_batch(pool: asyncpg.Pool) -> None:
    first = (datetime.now(UTC) + timedelta(seconds=2)).replace(microsecond=0)
    jobs = JobService(pool)
    for ms in (0, 4, 8, 12, 16):  # within fire_coalesce_sec (20 ms) of the first
        await jobs.create("team-a", spec({"at": (first + timedelta(milliseconds=ms)).isoformat()}), datetime.now(UTC))
    node = SchedulerNode(pool, FAST_SCHEDULER, node_id="node")
    batches: list[int] = []
    fire = node.store.fire

    async def counting(leases: dict[int, int], fires: list, fired_at: datetime) -> FireResult:
        batches.append(len(fires))
        return await fire(leases, fires, fired_at)

    node.store.fire = counting  # type: ignore[method-assign]
    running = asyncio.create_task(node.run())
    try:
        await wait_for(lambda: _runs(pool, 5), timeout=15, what="five runs")
    finally:
        node.stop()
        await running
    assert batches == [5]


async def _runs(pool: asyncpg.Pool, count: int) -> bool:
    return await pool.fetchval("SELECT count(*) FROM runs") == count


@contextlib.asynccontextmanager
async def trigger_locked(pool: asyncpg.Pool, job_id: object) -> AsyncIterator[None]:
    """Another transaction holds the job's trigger row: a batch that fires it waits until the block ends."""
    async with pool.acquire() as holder:
        transaction = holder.transaction()
        await transaction.start()
        await holder.execute("SELECT 1 FROM triggers WHERE job_id = $1 FOR UPDATE", job_id)
        try:
            yield
        finally:
            await transaction.rollback()


YEARLY = {"cron": "0 0 1 1 *"}


async def test_the_health_check_and_the_reaper_wait_until_a_burst_is_fired(pool: asyncpg.Pool) -> None:
    # What they read grows with all jobs and runs: they must not compete with the fires.
    job_id = await make_due_job(pool, YEARLY)  # its next slot must not come due while the test runs
    node = SchedulerNode(pool, replace(FAST_SCHEDULER, after_burst_max_wait_sec=60), node_id="busy-node")
    ran: list[bool] = []

    async def step() -> None:
        ran.append(node.firing())

    running = asyncio.create_task(node.run())
    try:
        async with trigger_locked(pool, job_id):
            await wait_for(lambda: _fire_waiting(pool), timeout=15, what="the node's batch to wait mid-statement")
            assert node.firing()
            deferred = asyncio.create_task(node.after_burst(step)())
            await asyncio.sleep(0.5)  # the step waits for the batch, however long it takes
            assert ran == [] and not deferred.done()
        await wait_for(lambda: ran, timeout=15, what="the step once the batch was fired")
        await deferred
        assert ran == [False]
        assert await pool.fetchval("SELECT count(*) FROM runs WHERE job_id = $1", job_id) == 1
    finally:
        node.stop()
        await running


async def test_a_burst_that_does_not_end_delays_the_health_check_by_at_most_its_limit(pool: asyncpg.Pool) -> None:
    job_id = await make_due_job(pool, YEARLY)
    node = SchedulerNode(pool, replace(FAST_SCHEDULER, after_burst_max_wait_sec=1.0), node_id="busy-node")
    ran: list[bool] = []

    async def step() -> None:
        ran.append(node.firing())

    running = asyncio.create_task(node.run())
    try:
        async with trigger_locked(pool, job_id):
            await wait_for(lambda: _fire_waiting(pool), timeout=15, what="the node's batch to wait mid-statement")
            loop = asyncio.get_running_loop()
            started = loop.time()
            await asyncio.wait_for(node.after_burst(step)(), timeout=10)
            assert loop.time() - started >= 1.0
            assert ran == [True]  # still firing: it ran anyway
    finally:
        node.stop()
        await running


async def test_a_node_with_nothing_due_runs_the_health_check_at_once(pool: asyncpg.Pool) -> None:
    node = SchedulerNode(pool, replace(FAST_SCHEDULER, after_burst_max_wait_sec=60), node_id="idle-node")
    ran: list[bool] = []

    async def step() -> None:
        ran.append(node.firing())

    await asyncio.wait_for(node.after_burst(step)(), timeout=5)
    assert ran == [False]


async def test_a_node_behind_a_burst_does_not_reread_the_keys_it_holds_every_second(pool: asyncpg.Pool) -> None:
    node = SchedulerNode(pool, FAST_SCHEDULER, node_id="behind-node")
    everything = list(range(1024))
    late = await make_due_job(pool)  # due a second ago
    [held] = await node._due_before(everything, datetime.now(UTC) + timedelta(seconds=3))
    assert held.job_id == late and node.wheel.add(held)  # held, not fired: the node is behind
    written = await make_due_job(pool)  # written since, into the part of the look-ahead already read
    assert await node._due_before(everything, datetime.now(UTC) + timedelta(seconds=3)) == []
    # Its partitions changed (one lost): it re-reads at once.
    spare = next(p for p in everything if p not in {partition_of(late), partition_of(written)})
    fewer = [p for p in everything if p != spare]
    assert [t.job_id for t in await node._due_before(fewer, datetime.now(UTC) + timedelta(seconds=3))] == [written]
    assert await node._due_before(fewer, datetime.now(UTC) + timedelta(seconds=3)) == []  # behind again
    node.wheel.done(node.wheel.pop_due(datetime.now(UTC).timestamp()))  # the backlog is fired (or failed)
    found = await node._due_before(fewer, datetime.now(UTC) + timedelta(seconds=3))
    assert sorted(t.job_id for t in found) == sorted([late, written])  # neither is held now: both read again


async def job_due_at(pool: asyncpg.Pool, at: datetime) -> tuple[uuid.UUID, int]:
    created = await JobService(pool).create("team-a", spec({"cron": "0 0 1 1 *"}), datetime.now(UTC))
    await pool.execute("UPDATE triggers SET fire_at = $2 WHERE job_id = $1", created.job_id, at)
    return created.job_id, partition_of(created.job_id)


async def test_a_node_reads_again_only_the_keys_of_partitions_whose_sums_changed(
        pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch) -> None:
    node = SchedulerNode(pool, FAST_SCHEDULER, node_id="sums-node")
    everything = list(range(1024))
    soon = datetime.now(UTC) + timedelta(seconds=30)  # due within the look-ahead, so the node is not behind
    first, first_partition = await job_due_at(pool, soon + timedelta(microseconds=123_457))
    await job_due_at(pool, soon + timedelta(seconds=7, microseconds=654_321))
    read_keys_of: list[list[int]] = []
    scan_due_keys = node.store.scan_due_keys

    async def recorded(partitions: list[int], before: datetime, limit: int) -> list:
        read_keys_of.append(sorted(partitions))
        return await scan_due_keys(partitions, before, limit)

    monkeypatch.setattr(node.store, "scan_due_keys", recorded)

    def until() -> datetime:
        return datetime.now(UTC) + timedelta(seconds=60)

    node.wheel.add_all(await node._due_before(everything, until()))
    assert len(node.wheel) == 2
    # Nothing written since: the sums match to the microsecond and no key is read again.
    assert await node._due_before(everything, until()) == []
    assert read_keys_of == []
    # A job written into the part already read: only its partition's keys are read.
    written, written_partition = await job_due_at(pool, soon + timedelta(seconds=1))
    found = await node._due_before(everything, until())
    assert [t.job_id for t in found] == [written]
    assert read_keys_of == [[written_partition]]
    node.wheel.add_all(found)
    # A trigger moved by a microsecond: its partition's sums change, and the moved trigger is read.
    await pool.execute("UPDATE triggers SET fire_at = fire_at + interval '1 microsecond' WHERE job_id = $1", first)
    read_keys_of.clear()
    moved = await node._due_before(everything, until())
    assert [(t.job_id, t.fire_at) for t in moved] == [(first, soon + timedelta(microseconds=123_458))]
    assert read_keys_of == [[first_partition]]


async def test_a_batch_that_ends_while_the_database_counts_leaves_its_partitions_for_the_next_check(
        pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch) -> None:
    node = SchedulerNode(pool, FAST_SCHEDULER, node_id="counting-node")
    everything = list(range(1024))
    until = datetime.now(UTC) + timedelta(seconds=60)
    fired_job, fired_partition = await job_due_at(pool, datetime.now(UTC) + timedelta(seconds=30))
    [held] = await node._due_before(everything, until)
    node.wheel.add(held)
    read_keys_of: list[list[int]] = []
    scan_due_keys, due_trigger_sums = node.store.scan_due_keys, node.store.due_trigger_sums

    async def recorded(partitions: list[int], before: datetime, limit: int) -> list:
        read_keys_of.append(sorted(partitions))
        return await scan_due_keys(partitions, before, limit)

    async def counted_as_a_batch_ends(partitions: list[int], before: datetime) -> dict:
        # The batch firing the trigger committed before the count, and ends before the count is back.
        in_flight = node.wheel.pop_due(until.timestamp())
        await pool.execute("DELETE FROM triggers WHERE job_id = $1", fired_job)
        sums = await due_trigger_sums(partitions, before)
        node._batch_ended(in_flight)
        return sums

    monkeypatch.setattr(node.store, "scan_due_keys", recorded)
    monkeypatch.setattr(node.store, "due_trigger_sums", counted_as_a_batch_ends)
    assert await node._due_before(everything, until + timedelta(seconds=1)) == []
    assert read_keys_of == []  # its partition's sums differed, but only because of the batch
    # Had the last whole check been too long ago, that partition's keys would have been read.
    written, _ = await job_due_at(pool, datetime.now(UTC) + timedelta(seconds=30))
    await pool.execute("UPDATE triggers SET partition_id = $2 WHERE job_id = $1", written, fired_partition)
    node.wheel.add(held)
    node._keys_read_at -= FAST_SCHEDULER.after_burst_max_wait_sec
    assert [t.job_id for t in await node._due_before(everything, until + timedelta(seconds=2))] == [written]
    assert read_keys_of == [[fired_partition]]
