"""A burst's instant is fired ahead of it and committed at it (SchedulerStore.fire_ahead).

The node writes the runs of a large instant up to ``fire_ahead_sec`` before it, in a transaction it
commits only once the database's clock has reached the instant: the work is done ahead, and nothing
is seen early. Here against a real PostgreSQL, with an in-process node and no worker, so that the
runs stay as the fire left them: none is there before its time, every one is there after it, and a
job paused while its batch waits gets no run, exactly as if its trigger had fired at its time.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx

from chimes.scheduler.node import SchedulerConfig, SchedulerNode
from tests.helpers import wait_for
from tests.integration.fleet import FAST_SCHEDULER
from tests.integration.test_core_loop import http_job
from tests.target import Target

AHEAD = replace(FAST_SCHEDULER, fire_ahead_sec=1.5, fire_ahead_min=5, fire_ahead_batch_size=5)


async def one_offs(client: httpx.AsyncClient, target: Target, at: datetime, count: int,
                   concurrency: str = "allow") -> list[uuid.UUID]:
    jobs = [(await client.post("/jobs", json=http_job(target, f"/burst-{concurrency}-{i}", {"at": at.isoformat()},
                                                      concurrency=concurrency))).json()
            for i in range(count)]
    return [uuid.UUID(job["jobId"]) for job in jobs]


def an_instant(seconds: float) -> datetime:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).replace(microsecond=0)


async def an_active_run(pool: asyncpg.Pool, job_id: uuid.UUID) -> uuid.UUID:
    """A run of the job still running (a manual one), tracked by the concurrency bookkeeping."""
    run_id = uuid.uuid4()
    await pool.execute("""
        WITH run AS (
            INSERT INTO runs (run_id, scheduled_at, job_id, owner, partition_id, job_version, trigger, priority,
                              status, fired_at, started_at)
            SELECT $2, now(), j.job_id, j.owner, t.partition_id, j.version, 'manual', j.priority, 'running', now(),
                   now()
            FROM jobs j JOIN triggers t ON t.job_id = j.job_id WHERE j.job_id = $1
            RETURNING job_id, run_id, scheduled_at
        )
        INSERT INTO active_runs (job_id, run_id, scheduled_at) SELECT job_id, run_id, scheduled_at FROM run
    """, job_id, run_id)
    return run_id


async def batches_waiting(pool: asyncpg.Pool) -> int:
    """Batches whose fire statement has run and whose transaction waits for the instant: the queue's
    NOTIFY is the last statement a batch sends before it waits."""
    return int(await pool.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' "
        "AND query LIKE '%pg_notify(''chimes_run_queue''%'"))


@asynccontextmanager
async def running(pool: asyncpg.Pool, config: SchedulerConfig) -> AsyncIterator[SchedulerNode]:
    node = SchedulerNode(pool, config, node_id="node-ahead")
    task = asyncio.create_task(node.run())
    try:
        yield node
    finally:
        node.stop()
        await task


async def test_a_burst_fired_ahead_is_seen_from_its_instant_on(
    pool: asyncpg.Pool, client: httpx.AsyncClient, target: Target
) -> None:
    instant = an_instant(5)
    jobs = await one_offs(client, target, instant, 15)
    seen: list[tuple[datetime, int]] = []  # (the database's clock, the burst's runs there) at each look

    async def all_there() -> bool:
        row = await pool.fetchrow("SELECT clock_timestamp() AS now, count(*) AS runs FROM runs "
                                  "WHERE job_id = ANY($1::uuid[])", jobs)
        seen.append((row["now"], row["runs"]))
        return bool(row["runs"] == len(jobs))

    async with running(pool, AHEAD) as node:
        # three batches of five, all written and waiting for the instant
        async def all_waiting() -> bool:
            return await batches_waiting(pool) == 3

        await wait_for(all_waiting, timeout=10, what="the batches fired ahead")
        assert await pool.fetchval("SELECT clock_timestamp()") < instant
        await wait_for(all_there, timeout=10, what="the burst's runs")
        before = [runs for now, runs in seen if now < instant]
        assert before and set(before) == {0}, f"runs were seen before their time: {seen}"
        assert seen[-1][0] >= instant
        assert node.stats.fired_ahead == len(jobs)
        assert node.stats.ahead_rolled_back == 0
    fired = await pool.fetch("SELECT fired_at, scheduled_at, status FROM runs WHERE job_id = ANY($1::uuid[])", jobs)
    assert {r["scheduled_at"] for r in fired} == {instant}
    assert {r["fired_at"] for r in fired} == {instant}, "a run fired ahead is recorded as fired at its time"
    assert {r["status"] for r in fired} == {"scheduled"}
    queued = await pool.fetchval("SELECT count(*) FROM run_queue WHERE job_id = ANY($1::uuid[])", jobs)
    assert queued == len(jobs)


async def test_a_job_paused_while_its_batch_waits_gets_no_run(
    pool: asyncpg.Pool, client: httpx.AsyncClient, target: Target
) -> None:
    instant = an_instant(5)
    jobs = await one_offs(client, target, instant, 8)
    paused = jobs[0]
    async with running(pool, replace(AHEAD, fire_ahead_batch_size=100)) as node:
        # the statement has decided, ahead of the instant, before anything changes
        await wait_for(lambda: batches_waiting(pool), timeout=10, what="the batch fired ahead")
        # A change that leaves the job's trigger alone (the API's own edits rewrite it, and wait for
        # the batch): the batch's check at its instant is all that can see it.
        await pool.execute("UPDATE jobs SET paused = true WHERE job_id = $1", paused)
        assert await pool.fetchval("SELECT clock_timestamp()") < instant
        await wait_for(lambda: node.stats.fired == len(jobs), timeout=10, what="the batch fired again at its time")
        assert node.stats.ahead_rolled_back == len(jobs)
        assert node.stats.fired_ahead == 0
    runs = await pool.fetch("SELECT job_id, fired_at FROM runs WHERE job_id = ANY($1::uuid[])", jobs)
    assert {r["job_id"] for r in runs} == set(jobs) - {paused}, "the paused job's slot made a run"
    assert all(r["fired_at"] >= instant for r in runs)


async def test_replace_jobs_fire_at_their_time_beside_a_batch_fired_ahead(
    pool: asyncpg.Pool, client: httpx.AsyncClient, target: Target
) -> None:
    instant = an_instant(5)
    ahead = await one_offs(client, target, instant, 6)
    on_time = await one_offs(client, target, instant, 6, concurrency="replace")
    async with running(pool, replace(AHEAD, fire_ahead_batch_size=100)) as node:
        await wait_for(lambda: node.stats.fired == 12, timeout=10, what="every trigger of the instant to fire")
        assert node.stats.fired_ahead == len(ahead)
    runs = await pool.fetch("SELECT job_id, fired_at, status FROM runs WHERE job_id = ANY($1::uuid[])",
                            ahead + on_time)
    assert sorted(r["job_id"] for r in runs) == sorted(ahead + on_time)
    assert {r["status"] for r in runs} == {"scheduled"}
    assert all(r["fired_at"] >= instant for r in runs)


async def test_a_skip_job_whose_active_run_ends_while_its_batch_waits_runs(
    pool: asyncpg.Pool, client: httpx.AsyncClient, target: Target
) -> None:
    """The batch decided "skip: the previous run is still active" ahead of time; that run ended before
    the instant, so at the instant the slot runs, as it would have had it fired then."""
    instant = an_instant(5)
    jobs = await one_offs(client, target, instant, 6, concurrency="skip")
    busy = jobs[0]
    previous = await an_active_run(pool, busy)
    async with running(pool, replace(AHEAD, fire_ahead_batch_size=100)) as node:
        # the statement has decided, ahead of the instant, before anything changes
        await wait_for(lambda: batches_waiting(pool), timeout=10, what="the batch fired ahead")
        await pool.execute("WITH ended AS (UPDATE runs SET status = 'succeeded', finished_at = now() "
                           "WHERE run_id = $1 RETURNING run_id) "
                           "DELETE FROM active_runs a USING ended e WHERE a.run_id = e.run_id", previous)  # it ended
        assert await pool.fetchval("SELECT clock_timestamp()") < instant
        await wait_for(lambda: node.stats.fired == len(jobs), timeout=10, what="the batch fired again at its time")
        assert node.stats.ahead_rolled_back == len(jobs)
    statuses = dict(await pool.fetch("SELECT job_id, status FROM runs WHERE job_id = ANY($1::uuid[])", jobs))
    assert statuses == {job: "scheduled" for job in jobs}, "a slot was skipped for a run that had ended"


async def test_a_skip_job_with_its_run_still_active_is_skipped_ahead(
    pool: asyncpg.Pool, client: httpx.AsyncClient, target: Target
) -> None:
    instant = an_instant(5)
    jobs = await one_offs(client, target, instant, 6, concurrency="skip")
    busy = jobs[0]
    await an_active_run(pool, busy)
    async with running(pool, replace(AHEAD, fire_ahead_batch_size=100)) as node:
        await wait_for(lambda: node.stats.fired == len(jobs), timeout=10, what="the instant to fire")
        assert node.stats.fired_ahead == len(jobs)
    statuses = dict(await pool.fetch("SELECT job_id, status FROM runs WHERE job_id = ANY($1::uuid[])", jobs))
    assert statuses == {job: "skipped" if job == busy else "scheduled" for job in jobs}


async def test_an_instant_under_the_minimum_fires_at_its_time(
    pool: asyncpg.Pool, client: httpx.AsyncClient, target: Target
) -> None:
    instant = an_instant(4)
    jobs = await one_offs(client, target, instant, 4)
    async with running(pool, AHEAD) as node:
        await wait_for(lambda: node.stats.fired == len(jobs), timeout=10, what="the instant to fire")
        assert node.stats.fired_ahead == 0
        assert node._ahead_in_flight == 0
