"""Retention drops whole days of history; poison runs stop being retried."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg

from chimes.ids import run_id_for
from chimes.scheduler.firing import plan_fires
from chimes.scheduler.reaper import POISON_AFTER, Reaper
from chimes.scheduler.retention import Retention
from chimes.store.scheduling import SchedulerStore
from chimes.store.working import WorkerStore
from tests.helpers import expire_run_lease, wait_for
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
    result = await Retention(pool, days=30).sweep(datetime.now(UTC))
    assert result.dropped == 2 and result.deferred == []  # runs_<day> and run_attempts_<day>
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
        claimed = await WorkerStore(pool, f"doomed-{loss}").claim(10, lease_sec=30, deadline_grace_sec=30)
        assert len(claimed) == 1
        await expire_run_lease(pool, claimed[0].run_id)  # the worker dies: its lease runs out
        assert await reaper.sweep(leases, datetime.now(UTC)) == 1
    run = await pool.fetchrow("SELECT * FROM runs")
    assert run["status"] == "failed" and "poison run" in run["error"] and run["lease_losses"] == POISON_AFTER
    assert await pool.fetchval("SELECT count(*) FROM run_queue") == 0
    assert await pool.fetchval("SELECT count(*) FROM active_runs") == 0


async def test_retention_gives_way_to_a_long_reader_and_drops_the_day_later(pool: asyncpg.Pool,
                                                                              database_url: str) -> None:
    old_day = datetime.now(UTC).replace(hour=12, minute=0, second=0, microsecond=0) - timedelta(days=40)
    await pool.execute("SELECT chimes_ensure_run_partitions($1::date, 1)", old_day.date())
    await insert_run(pool, old_day)
    retention = Retention(pool, days=30, lock_timeout_sec=0.5)
    long_reader = await asyncpg.connect(database_url)
    try:
        # A report reading run history in a long transaction: it holds its lock on runs until it ends.
        reading = long_reader.transaction()
        await reading.start()
        await long_reader.fetchval("SELECT count(*) FROM runs")
        started = time.monotonic()
        sweep = asyncio.create_task(retention.sweep(datetime.now(UTC)))
        # While the drop waits for its lock, another reader comes: it must not queue behind the drop.
        await wait_for(lambda: sweep.done() or _waiting_for_a_lock(pool), timeout=10, interval=0.01,
                       what="the drop to wait for its lock")
        async with asyncio.timeout(2.0):
            assert await pool.fetchval("SELECT count(*) FROM runs") == 1
        result = await sweep
        assert time.monotonic() - started < 3.0
        assert result.dropped == 0 and result.deferred == [f"run_attempts_{old_day:%Y%m%d}", f"runs_{old_day:%Y%m%d}"]
        assert await pool.fetchval("SELECT to_regclass($1)", f"runs_{old_day:%Y%m%d}") is not None
        await reading.commit()
    finally:
        await long_reader.close()
    # The reader is done: the next round drops the day.
    later = await retention.sweep(datetime.now(UTC))
    assert later.dropped == 2 and later.deferred == []
    assert await pool.fetchval("SELECT to_regclass($1)", f"runs_{old_day:%Y%m%d}") is None


async def _waiting_for_a_lock(pool: asyncpg.Pool) -> bool:
    return await pool.fetchval("SELECT count(*) FROM pg_locks WHERE NOT granted") > 0


async def test_retention_removes_old_delivered_and_dead_notifications(pool: asyncpg.Pool) -> None:
    old, recent = timedelta(days=40), timedelta(days=2)
    rows = {"old sent": (old, "sent"), "old dead": (old, "dead"), "old pending": (old, None),
            "recent sent": (recent, "sent"), "recent dead": (recent, "dead")}
    for kind, (age, ended) in rows.items():
        await pool.execute(
            "INSERT INTO notifications (notification_id, job_id, owner, kind, url, payload, created_at, sent_at,"
            " dead_at) VALUES (gen_random_uuid(), gen_random_uuid(), 'team-a', $1, 'http://127.0.0.1:9/', '{}',"
            " now() - $2::interval, CASE WHEN $3 = 'sent' THEN now() END, CASE WHEN $3 = 'dead' THEN now() END)",
            kind, age, ended)
    result = await Retention(pool, days=30, notification_batch=1).sweep(datetime.now(UTC))
    assert result.notifications_deleted == 2
    left = {r["kind"] for r in await pool.fetch("SELECT kind FROM notifications")}
    assert left == {"old pending", "recent sent", "recent dead"}
