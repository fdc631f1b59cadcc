"""The invariants of firing, checked at the store: fencing tokens, job versions, one run per slot,
and the reaper's conditional writes."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import asyncpg

from chimes.ids import partition_of
from chimes.jobs import JobPatch, JobSpec
from chimes.scheduler.firing import plan_fires
from chimes.scheduler.reaper import Reaper
from chimes.services.jobs import JobService
from chimes.store.scheduling import SchedulerStore
from chimes.store.working import Completion, WorkerStore
from chimes.worker.tasks.common import Outcome
from tests.helpers import expire_run_lease

ALL = list(range(1024))


def spec(schedule: dict, callback: bool = False) -> JobSpec:
    return JobSpec.model_validate(
        {"name": "j", "schedule": schedule,
         "task": {"type": "http", "url": "http://127.0.0.1:9/", "callback": callback},
         "retryPolicy": {"maxAttempts": 2, "jitter": 0}})


async def make_due_job(pool: asyncpg.Pool, schedule: dict | None = None, callback: bool = False) -> uuid.UUID:
    """A job whose trigger is already due (its fire time is moved into the past). ``callback``: its
    target reports the outcome itself, and each run has a lease of its own (migration 0015)."""
    created = await JobService(pool).create("team-a", spec(schedule or {"cron": "* * * * *"}, callback),
                                            datetime.now(UTC))
    await pool.execute("UPDATE triggers SET fire_at = date_trunc('second', now()) - interval '1 second' "
                       "WHERE job_id = $1", created.job_id)
    return created.job_id


async def take_all(store: SchedulerStore) -> dict[int, int]:
    return (await store.sync_leases("host", 1, {}, ttl_sec=30)).held


async def fire_due_one_offs(pool: asyncpg.Pool, count: int) -> tuple[SchedulerStore, dict[int, int]]:
    """``count`` one-off jobs due a second ago, fired by a node holding every partition: their runs are queued."""
    for _ in range(count):
        await make_due_job(pool, {"at": (datetime.now(UTC) - timedelta(seconds=1)).isoformat()})
    store = SchedulerStore(pool, "node")
    leases = await take_all(store)
    await store.fire(leases, plan_fires(await due(store, leases)), datetime.now(UTC))
    return store, leases


async def stall(pool: asyncpg.Pool, node_id: str) -> None:
    """The node stops (SIGSTOP, GC pause, partition): its heartbeat and leases run out."""
    await pool.execute("UPDATE scheduler_nodes SET heartbeat_at = now() - interval '1 minute' WHERE node_id = $1",
                       node_id)
    await pool.execute("UPDATE partition_leases SET expires_at = now() - interval '1 second' WHERE owner = $1",
                       node_id)


async def due(store: SchedulerStore, leases: dict[int, int]) -> list:
    return await store.scan_due(list(leases), datetime.now(UTC) + timedelta(seconds=5), 1000)


async def test_stale_fencing_token_fires_nothing(pool: asyncpg.Pool) -> None:
    job_id = await make_due_job(pool)
    old = SchedulerStore(pool, "node-old")
    old_leases = await take_all(old)
    assert len(old_leases) == 1024
    triggers = await due(old, old_leases)
    # The old node stalls; its leases expire and another node takes the partitions (token + 1).
    await stall(pool, "node-old")
    new = SchedulerStore(pool, "node-new")
    new_leases = await take_all(new)
    assert new_leases[partition_of(job_id)] == old_leases[partition_of(job_id)] + 1
    refused = await old.fire(old_leases, plan_fires(triggers), datetime.now(UTC))
    assert (refused.leases_held, refused.fired, refused.enqueued) == (0, 0, 0)
    assert await pool.fetchval("SELECT count(*) FROM runs") == 0
    accepted = await new.fire(new_leases, plan_fires(await due(new, new_leases)), datetime.now(UTC))
    assert (accepted.fired, accepted.enqueued) == (1, 1)
    assert await pool.fetchval("SELECT count(*) FROM runs") == 1


async def test_renewal_fails_after_takeover(pool: asyncpg.Pool) -> None:
    old = SchedulerStore(pool, "node-old")
    old_leases = await take_all(old)
    await stall(pool, "node-old")
    assert len(await take_all(SchedulerStore(pool, "node-new"))) == 1024
    # The old node wakes up: nothing is renewed, and no partition held by the live node is taken.
    assert (await old.sync_leases("host", 1, old_leases, ttl_sec=30)).held == {}
    owners = await pool.fetch("SELECT DISTINCT owner FROM partition_leases")
    assert [r["owner"] for r in owners] == ["node-new"]


async def test_expired_but_untaken_lease_is_renewed_with_same_token(pool: asyncpg.Pool) -> None:
    """Nobody fired in between (the token is unchanged), so continuing is safe."""
    node = SchedulerStore(pool, "node")
    leases = await take_all(node)
    await pool.execute("UPDATE partition_leases SET expires_at = now() - interval '1 second'")
    assert (await node.sync_leases("host", 1, leases, ttl_sec=30)).held == leases


async def test_partitions_rebalance_between_nodes(pool: asyncpg.Pool) -> None:
    a, b = SchedulerStore(pool, "node-a"), SchedulerStore(pool, "node-b")
    held_a = await take_all(a)
    assert len(held_a) == 1024
    first = await b.sync_leases("host", 2, {}, ttl_sec=30)
    held_b = first.held
    assert held_b == {} and first.share == 512  # nothing is free yet
    held_a = (await a.sync_leases("host", 1, held_a, ttl_sec=30)).held  # a sees b and sheds half
    assert len(held_a) == 512
    held_b = (await b.sync_leases("host", 2, held_b, ttl_sec=30)).held
    assert len(held_b) == 512 and not set(held_a) & set(held_b)


async def test_edit_after_scan_fires_nothing_from_old_version(pool: asyncpg.Pool) -> None:
    """An edit of the schedule after the node read the due trigger: the batch the node planned from
    the old definition fires nothing; the due slot is kept for the new version's trigger to fire."""
    job_id = await make_due_job(pool)
    [due_at] = [r["fire_at"] for r in await pool.fetch("SELECT fire_at FROM triggers WHERE job_id = $1", job_id)]
    store = SchedulerStore(pool, "node")
    leases = await take_all(store)
    triggers = await due(store, leases)
    await JobService(pool).update(job_id, None, JobPatch(schedule={"cron": "0 0 1 1 *"}), datetime.now(UTC))
    result = await store.fire(leases, plan_fires(triggers), datetime.now(UTC))
    assert result.fired == 0
    assert await pool.fetchval("SELECT count(*) FROM runs") == 0
    kept = await pool.fetch("SELECT fire_at, job_version FROM triggers WHERE job_id = $1 ORDER BY fire_at", job_id)
    assert [(r["fire_at"] == due_at, r["job_version"]) for r in kept] == [(True, 2), (False, 2)]
    again = await store.fire(leases, plan_fires(await due(store, leases), datetime.now(UTC)), datetime.now(UTC))
    assert again.fired == 1
    assert await pool.fetchval("SELECT scheduled_at FROM runs") == due_at  # the old definition's slot, once


async def test_an_edit_of_what_no_fire_reads_leaves_the_batch_to_fire(pool: asyncpg.Pool) -> None:
    """A rename after the node read the due trigger changes nothing the fire planned by: the batch
    fires, and the run is recorded at the job's new version."""
    job_id = await make_due_job(pool)
    store = SchedulerStore(pool, "node")
    leases = await take_all(store)
    triggers = await due(store, leases)
    await JobService(pool).update(job_id, None, JobPatch(name="edited"), datetime.now(UTC))
    result = await store.fire(leases, plan_fires(triggers), datetime.now(UTC))
    assert (result.fired, result.enqueued) == (1, 1)
    assert await pool.fetchval("SELECT job_version FROM runs") == 2


async def test_pause_and_delete_after_scan_fire_nothing(pool: asyncpg.Pool) -> None:
    paused, deleted = await make_due_job(pool), await make_due_job(pool)
    store = SchedulerStore(pool, "node")
    leases = await take_all(store)
    triggers = await due(store, leases)
    jobs = JobService(pool)
    await jobs.update(paused, None, JobPatch(paused=True), datetime.now(UTC))
    await jobs.delete(deleted, None)
    result = await store.fire(leases, plan_fires(triggers), datetime.now(UTC))
    assert result.fired == 0
    assert await pool.fetchval("SELECT count(*) FROM runs") == 0


async def test_stale_trigger_left_by_a_race_fires_nothing(pool: asyncpg.Pool) -> None:
    """A trigger of an old version that survived (an edit racing a fire) is removed without a run."""
    job_id = await make_due_job(pool)
    await pool.execute("UPDATE jobs SET version = 2, catch_up = '{\"policy\": \"none\"}' WHERE job_id = $1", job_id)
    store = SchedulerStore(pool, "node")
    leases = await take_all(store)
    result = await store.fire(leases, plan_fires(await due(store, leases)), datetime.now(UTC))
    assert result.fired == 1 and result.enqueued == 0
    assert await pool.fetchval("SELECT count(*) FROM runs") == 0
    assert await pool.fetchval("SELECT count(*) FROM triggers") == 0


async def test_same_slot_fired_twice_makes_one_run(pool: asyncpg.Pool) -> None:
    """A crash after enqueueing but before advancing leaves the old trigger: firing it again is harmless."""
    job_id = await make_due_job(pool)
    store = SchedulerStore(pool, "node")
    leases = await take_all(store)
    triggers = await due(store, leases)
    [old_trigger] = await pool.fetch("SELECT * FROM triggers WHERE job_id = $1", job_id)
    first = await store.fire(leases, plan_fires(triggers), datetime.now(UTC))
    assert first.enqueued == 1
    # Put the fired trigger back, as if the advance had never been written.
    await pool.execute("INSERT INTO triggers VALUES ($1, $2, $3, $4, $5, $6)", *old_trigger.values())
    second = await store.fire(leases, plan_fires(triggers), datetime.now(UTC))
    assert second.fired == 1 and second.enqueued == 0
    assert await pool.fetchval("SELECT count(*) FROM runs") == 1
    assert await pool.fetchval("SELECT count(*) FROM run_queue") == 1
    next_fires = await pool.fetch("SELECT fire_at FROM triggers WHERE job_id = $1", job_id)
    assert len(next_fires) == 1 and next_fires[0]["fire_at"] > old_trigger["fire_at"]


async def test_reaper_requeues_lost_run_and_refuses_the_lost_worker(pool: asyncpg.Pool) -> None:
    await make_due_job(pool, {"at": (datetime.now(UTC) - timedelta(seconds=1)).isoformat()})
    store = SchedulerStore(pool, "node")
    leases = await take_all(store)
    await store.fire(leases, plan_fires(await due(store, leases)), datetime.now(UTC))
    lost_worker = WorkerStore(pool, "worker-that-dies")
    [claimed] = await lost_worker.claim(10, lease_sec=30, deadline_grace_sec=30)
    await expire_run_lease(pool, claimed.run_id)  # the worker died: its lease runs out
    reaped = await Reaper(store).sweep(leases, datetime.now(UTC))
    assert reaped == 1
    run = await pool.fetchrow("SELECT * FROM runs")
    assert run["status"] == "scheduled" and run["attempt"] == 2
    [attempt] = await pool.fetch("SELECT * FROM run_attempts")
    assert attempt["attempt"] == 1 and attempt["worker_id"] == "worker-that-dies"
    assert "stopped heartbeating" in attempt["error"]
    # The lost worker comes back and reports success: refused, the run is someone else's now.
    late = Completion(claimed, Outcome.success(), datetime.now(UTC), None)
    assert await lost_worker.complete([late]) == set()
    assert await lost_worker.extend_leases([claimed], 30) == set()
    # Another worker takes the re-enqueued run as attempt 2.
    [again] = await WorkerStore(pool, "worker-2").claim(10, lease_sec=30, deadline_grace_sec=30)
    assert again.run_id == claimed.run_id and again.attempt == 2


async def test_reaper_fails_run_with_no_attempts_left(pool: asyncpg.Pool) -> None:
    await make_due_job(pool, {"at": (datetime.now(UTC) - timedelta(seconds=1)).isoformat()})
    store = SchedulerStore(pool, "node")
    leases = await take_all(store)
    await store.fire(leases, plan_fires(await due(store, leases)), datetime.now(UTC))
    worker = WorkerStore(pool, "w")
    await pool.execute("UPDATE runs SET attempt = 2")  # the policy allows 2 attempts
    [claimed] = await worker.claim(10, lease_sec=30, deadline_grace_sec=30)
    await expire_run_lease(pool, claimed.run_id)
    assert await Reaper(store).sweep(leases, datetime.now(UTC)) == 1
    run = await pool.fetchrow("SELECT * FROM runs")
    assert run["status"] == "failed" and "no attempts left" in run["error"]
    assert await pool.fetchval("SELECT count(*) FROM run_queue") == 0


async def test_reaper_refuses_without_lease(pool: asyncpg.Pool) -> None:
    await make_due_job(pool, {"at": (datetime.now(UTC) - timedelta(seconds=1)).isoformat()})
    store = SchedulerStore(pool, "node")
    leases = await take_all(store)
    await store.fire(leases, plan_fires(await due(store, leases)), datetime.now(UTC))
    [claimed] = await WorkerStore(pool, "w").claim(10, lease_sec=30, deadline_grace_sec=30)
    await expire_run_lease(pool, claimed.run_id)
    await pool.execute("UPDATE partition_leases SET token = token + 1")  # someone else took over
    assert await Reaper(store).sweep(leases, datetime.now(UTC)) == 0
    assert await pool.fetchval("SELECT status FROM runs") == "running"
    # The fence alone held it back: the run is expired, and whoever holds the new token reaps it.
    current = {p: token + 1 for p, token in leases.items()}
    assert await Reaper(store).sweep(current, datetime.now(UTC)) == 1
