"""A run that succeeds keeps its last attempt on the run row, with no attempt row of its own
(migration 0013): readers see every attempt through ``run_attempt_history``, the run's detail
(RunStore.get) included, exactly as before."""

from __future__ import annotations

import asyncpg

from chimes.scheduler.reaper import Reaper
from chimes.store.runs import RunStore
from chimes.store.working import Completion, WorkerStore
from chimes.worker.tasks.common import Outcome
from tests.integration.test_fences import expire_run_lease, now, running_run

LONGEST_KEPT_ON_THE_RUN = 16  # bytes of output (complete_runs)


async def attempt_rows(pool: asyncpg.Pool) -> int:
    return await pool.fetchval("SELECT count(*) FROM run_attempts")


async def history(pool: asyncpg.Pool) -> list[tuple]:
    rows = await pool.fetch("SELECT attempt, worker_id, status, error, output FROM run_attempt_history "
                            "ORDER BY attempt")
    return [tuple(r.values()) for r in rows]


async def test_a_success_is_kept_on_the_run_and_read_back_as_its_attempt(pool: asyncpg.Pool) -> None:
    _, _, claimed = await running_run(pool)
    output = "é" * (LONGEST_KEPT_ON_THE_RUN // 2)  # 16 bytes, 8 characters
    done = Completion(claimed, Outcome.success(output), now(), None)
    assert await WorkerStore(pool, "worker-1").complete([done]) == {claimed.run_id}
    assert await attempt_rows(pool) == 0
    run = await pool.fetchrow("SELECT * FROM runs")
    assert (run["status"], run["output"]) == ("succeeded", output)
    detail = await RunStore(pool).get(claimed.run_id, None)
    assert detail is not None
    [attempt] = detail.attempts
    assert (attempt["attempt"], attempt["worker_id"], attempt["status"], attempt["output"]) == (
        1, "worker-1", "succeeded", output)
    assert (attempt["started_at"], attempt["finished_at"]) == (run["started_at"], run["finished_at"])


async def test_a_longer_output_keeps_its_attempt_row(pool: asyncpg.Pool) -> None:
    _, _, claimed = await running_run(pool)
    output = "x" * (LONGEST_KEPT_ON_THE_RUN + 1)
    done = Completion(claimed, Outcome.success(output), now(), None)
    assert await WorkerStore(pool, "worker-1").complete([done]) == {claimed.run_id}
    assert await attempt_rows(pool) == 1
    assert await pool.fetchval("SELECT output FROM runs") is None
    assert await history(pool) == [(1, "worker-1", "succeeded", None, output)]


async def test_a_success_after_a_lost_attempt_follows_its_row(pool: asyncpg.Pool) -> None:
    store, leases, _ = await running_run(pool, "worker-1")
    await expire_run_lease(pool)
    assert await Reaper(store).sweep(leases, now()) == 1
    [second] = await WorkerStore(pool, "worker-2").claim(10, lease_sec=30, deadline_grace_sec=30)
    done = Completion(second, Outcome.success("ok"), now(), None)
    assert await WorkerStore(pool, "worker-2").complete([done]) == {second.run_id}
    assert await attempt_rows(pool) == 1
    [lost, succeeded] = await history(pool)
    assert lost[:3] == (1, "worker-1", "failed") and "stopped heartbeating" in lost[3]
    assert succeeded == (2, "worker-2", "succeeded", None, "ok")


async def test_an_outcome_from_another_than_the_claiming_worker_keeps_its_row(pool: asyncpg.Pool) -> None:
    """A callback task's target reports for itself (RunStore.callback_complete, worker "callback"):
    the attempt says who reported, the run still names the worker that handed the call over."""
    _, _, claimed = await running_run(pool, "worker-1")
    done = Completion(claimed, Outcome.success("done"), now(), None)
    assert await WorkerStore(pool, "callback").complete([done]) == {claimed.run_id}
    assert await history(pool) == [(1, "callback", "succeeded", None, "done")]
    assert await pool.fetchval("SELECT worker_id FROM runs") == "worker-1"


async def test_a_failure_keeps_its_row_where_failures_are_found(pool: asyncpg.Pool) -> None:
    _, _, claimed = await running_run(pool)
    done = Completion(claimed, Outcome.failure("HTTP 500", "boom"), now(), None)
    assert await WorkerStore(pool, "worker-1").complete([done]) == {claimed.run_id}
    assert await pool.fetchval("SELECT count(*) FROM run_attempts WHERE status = 'failed' "
                               "AND finished_at > now() - interval '1 minute'") == 1
    assert await pool.fetchval("SELECT output FROM runs") is None
    assert await history(pool) == [(1, "worker-1", "failed", "HTTP 500", "boom")]


async def test_a_success_recorded_before_the_migration_is_read_once(pool: asyncpg.Pool) -> None:
    """Runs that succeeded before migration 0013 have their attempt row (and no output on the run)."""
    _, _, claimed = await running_run(pool)
    done = Completion(claimed, Outcome.success("ok"), now(), None)
    assert await WorkerStore(pool, "worker-1").complete([done]) == {claimed.run_id}
    await pool.execute(
        "INSERT INTO run_attempts (run_id, scheduled_at, attempt, worker_id, status, started_at, finished_at, output)"
        " SELECT run_id, scheduled_at, attempt, worker_id, status, started_at, finished_at, output FROM runs")
    await pool.execute("UPDATE runs SET output = NULL")
    assert await history(pool) == [(1, "worker-1", "succeeded", None, "ok")]
