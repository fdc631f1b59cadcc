"""Retention drops whole days of history; poison runs stop being retried."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import asyncpg

from chimes.ids import run_id_for
from chimes.scheduler.firing import plan_fires
from chimes.scheduler.reaper import POISON_AFTER, Reaper
from chimes.store.migrate import drop_old_run_partitions
from chimes.store.scheduling import SchedulerStore
from chimes.store.working import WorkerStore
from tests.integration.test_fencing import due, make_due_job, take_all


async def insert_run(pool: asyncpg.Pool, scheduled_at: datetime) -> uuid.UUID:
    job_id = uuid.uuid4()
    run_id = run_id_for(job_id, scheduled_at)
    await pool.execute(
        "INSERT INTO runs (run_id, scheduled_at, job_id, owner, partition_id, job_version, trigger, priority, status)"
        " VALUES ($1, $2, $3, 'team-a', 0, 1, 'schedule', 1, 'succeeded')", run_id, scheduled_at, job_id)
    await pool.execute("INSERT INTO run_attempts (run_id, scheduled_at, attempt, status, finished_at)"
                       " VALUES ($1, $2, 1, 'succeeded', $2)", run_id, scheduled_at)
    return run_id


async def test_retention_drops_old_days_and_keeps_recent_ones(pool: asyncpg.Pool) -> None:
    today = datetime.now(UTC).replace(hour=12, minute=0, second=0, microsecond=0)
    old_day = today - timedelta(days=40)
    await pool.execute("SELECT chimes_ensure_run_partitions($1::date, 1)", old_day.date())
    old = await insert_run(pool, old_day)
    ancient = await insert_run(pool, today - timedelta(days=400))  # no partition: lands in the default one
    recent = await insert_run(pool, today - timedelta(days=1))
    async with pool.acquire() as conn:
        dropped = await drop_old_run_partitions(conn, retention_days=30)
    assert dropped == 2  # runs_<day> and run_attempts_<day>
    partition = f"runs_{old_day:%Y%m%d}"
    assert await pool.fetchval("SELECT to_regclass($1)", partition) is None
    kept = {r["run_id"] for r in await pool.fetch("SELECT run_id FROM runs")}
    assert recent in kept and old not in kept and ancient not in kept
    assert await pool.fetchval("SELECT count(*) FROM run_attempts") == 1


async def test_run_that_keeps_killing_workers_is_failed_as_poison(pool: asyncpg.Pool) -> None:
    await make_due_job(pool, {"at": (datetime.now(UTC) - timedelta(seconds=1)).isoformat()})
    await pool.execute("UPDATE jobs SET retry_policy = '{\"maxAttempts\": 10}'")
    store = SchedulerStore(pool, "node")
    leases = await take_all(store)
    await store.fire(leases, plan_fires(await due(store, leases)), datetime.now(UTC))
    reaper = Reaper(store)
    for loss in range(1, POISON_AFTER + 1):
        claimed = await WorkerStore(pool, f"doomed-{loss}").claim(10, lease_sec=0.1, deadline_grace_sec=30)
        assert len(claimed) == 1
        await pool.execute("SELECT pg_sleep(0.2)")  # the 0.1 s lease runs out on the database's clock
        assert await reaper.sweep(leases, datetime.now(UTC)) == 1
    run = await pool.fetchrow("SELECT * FROM runs")
    assert run["status"] == "failed" and "poison run" in run["error"] and run["lease_losses"] == POISON_AFTER
    assert await pool.fetchval("SELECT count(*) FROM run_queue") == 0
    assert await pool.fetchval("SELECT count(*) FROM active_runs") == 0
