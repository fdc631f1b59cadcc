"""A claim's runs share one lease row (claim_leases, migration 0015): written by the claim, renewed by
the heartbeat for all of them, judged run by run by the reaper, deleted once its runs are done.
A callback task's run, and a run its worker gave up, have a lease of their own (run_leases)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx

from chimes.scheduler.firing import plan_fires
from chimes.scheduler.reaper import Reaper, judge
from chimes.store import db
from chimes.store.runs import RunStore
from chimes.store.scheduling import SchedulerStore
from chimes.store.working import ClaimedRun, Completion, WorkerStore, open_claims_pool
from chimes.worker.tasks.common import Outcome
from tests.helpers import Homes, wait_for
from tests.integration.fleet import Fleet
from tests.integration.test_fences import open_transaction, until_blocked_or_done
from tests.integration.test_fencing import due, make_due_job, take_all
from tests.target import Target


def now() -> datetime:
    return datetime.now(UTC)


async def claimed_together(pool: asyncpg.Pool, count: int, callbacks: int = 0,
                           node: tuple[SchedulerStore, dict[int, int]] | None = None,
                           ) -> tuple[SchedulerStore, dict[int, int], list[ClaimedRun]]:
    """``count`` one-off runs (the first ``callbacks`` of callback tasks), fired and claimed in one
    claim; ``node``: the scheduler node and its partition leases, from an earlier call."""
    for number in range(count):
        await make_due_job(pool, {"at": (now() - timedelta(seconds=1)).isoformat()}, callback=number < callbacks)
    if node is None:
        store = SchedulerStore(pool, "node")
        node = store, await take_all(store)
    store, leases = node
    assert (await store.fire(leases, plan_fires(await due(store, leases)), now())).enqueued == count
    claimed = await WorkerStore(pool, "worker-1").claim(count, lease_sec=30, deadline_grace_sec=30)
    assert len(claimed) == count
    return store, leases, claimed


async def claim_rows(pool: asyncpg.Pool) -> list[asyncpg.Record]:
    return await pool.fetch("SELECT * FROM claim_leases")


async def test_a_claim_writes_one_lease_row_for_all_its_runs(pool: asyncpg.Pool) -> None:
    _, _, claimed = await claimed_together(pool, 5)
    [row] = await claim_rows(pool)
    assert {run.lease_token for run in claimed} == {row["token"]}
    assert sorted(row["run_ids"]) == sorted(run.run_id for run in claimed)
    assert row["scheduled_ats"] == [next(r.scheduled_at for r in claimed if r.run_id == i) for i in row["run_ids"]]
    assert row["deadline_at"] == min(row["deadlines"]) and row["expires_at"] < row["deadline_at"]
    assert await pool.fetchval("SELECT count(*) FROM run_leases") == 0
    assert await pool.fetchval("SELECT count(*) FROM leases_in_force") == 5


async def test_a_claim_on_the_claims_connection_is_a_statement_of_its_own_planned_by_key(
    pool: asyncpg.Pool, database_url: str
) -> None:
    """A worker's claims go through a connection whose session has begin_by_key's settings, one
    statement each: the runs are claimed, their lease row written and committed, and the worker's
    pool (closed here) is not used at all."""
    for _ in range(3):
        await make_due_job(pool, {"at": (now() - timedelta(seconds=1)).isoformat()})
    store = SchedulerStore(pool, "node")
    leases = await take_all(store)
    assert (await store.fire(leases, plan_fires(await due(store, leases)), now())).enqueued == 3
    claims = await open_claims_pool(database_url)
    closed = await db.create_pool(database_url, min_size=0, max_size=1)
    await closed.close()
    try:
        assert await claims.fetchval("SHOW enable_hashjoin") == "off"
        assert await claims.fetchval("SHOW plan_cache_mode") == "force_generic_plan"
        claimed = await WorkerStore(closed, "worker-1", claims=claims).claim(10, lease_sec=30, deadline_grace_sec=30)
        assert len(claimed) == 3
        assert await claims.fetchval("SELECT pg_current_xact_id_if_assigned()") is None  # no transaction left open
    finally:
        await claims.close()
    [row] = await claim_rows(pool)  # committed: seen from another session
    assert sorted(row["run_ids"]) == sorted(run.run_id for run in claimed)
    assert await pool.fetchval("SELECT count(*) FROM runs WHERE status = 'running'") == 3


async def test_a_callback_run_has_a_lease_of_its_own(pool: asyncpg.Pool) -> None:
    """Its target renews its lease, not the worker: the claim's row must not keep it alive."""
    _, _, claimed = await claimed_together(pool, 3, callbacks=1)
    own = await pool.fetch("SELECT run_id, token FROM run_leases")
    [row] = await claim_rows(pool)
    assert len(own) == 1 and own[0]["token"] == row["token"]
    assert own[0]["run_id"] not in row["run_ids"] and len(row["run_ids"]) == 2
    assert {r["run_id"] for r in await pool.fetch("SELECT run_id FROM leases_in_force")} == {
        run.run_id for run in claimed}


async def test_a_stale_lease_row_of_a_waiting_callback_run_does_not_fail_the_claim(pool: asyncpg.Pool) -> None:
    """A lease row left for a run that waits in the queue (a lease belongs to a running run) is
    replaced by the claim's: one such row once failed every claim of its home."""
    await make_due_job(pool, {"at": (now() - timedelta(seconds=1)).isoformat()}, callback=True)
    store = SchedulerStore(pool, "node")
    leases = await take_all(store)
    assert (await store.fire(leases, plan_fires(await due(store, leases)), now())).enqueued == 1
    run_id = await pool.fetchval("SELECT run_id FROM run_queue")
    await pool.execute("INSERT INTO run_leases (run_id, scheduled_at, partition_id, token, expires_at, deadline_at) "
                       "SELECT run_id, scheduled_at, partition_id, gen_random_uuid(), now(), now() "
                       "FROM runs WHERE run_id = $1", run_id)
    [claimed] = await WorkerStore(pool, "worker-1").claim(1, lease_sec=30, deadline_grace_sec=30)
    assert claimed.run_id == run_id
    lease = await pool.fetchrow("SELECT token, expires_at > now() AS live FROM run_leases WHERE run_id = $1", run_id)
    assert lease["token"] == claimed.lease_token and lease["live"]


async def test_a_heartbeat_renews_the_claim_once_for_all_its_runs(pool: asyncpg.Pool) -> None:
    _, _, claimed = await claimed_together(pool, 3)
    before = (await claim_rows(pool))[0]["expires_at"]
    worker = WorkerStore(pool, "worker-1")
    assert await worker.extend_leases(claimed, 3600) == {run.run_id for run in claimed}
    assert (await claim_rows(pool))[0]["expires_at"] > before + timedelta(minutes=50)
    # One run cancelled meanwhile: still renewed with the claim, but no longer held by the worker.
    assert await RunStore(pool).cancel(claimed[0].run_id, None, "cancelled by team-a")
    assert await worker.extend_leases(claimed, 3600) == {run.run_id for run in claimed[1:]}


async def test_the_reaper_ends_every_run_of_an_expired_claim(pool: asyncpg.Pool) -> None:
    store, leases, _ = await claimed_together(pool, 3)
    await pool.execute("UPDATE claim_leases SET expires_at = now() - interval '1 second'")
    assert await Reaper(store).sweep(leases, now()) == 3
    runs = await pool.fetch("SELECT status, attempt, lease_token, lease_losses FROM runs")
    assert [tuple(r) for r in runs] == [("scheduled", 2, None, 1)] * 3
    assert await pool.fetchval("SELECT count(*) FROM run_queue") == 3


async def test_a_run_past_its_deadline_is_reaped_alone(pool: asyncpg.Pool) -> None:
    """The claim's lease is alive; only the run whose own deadline passed is abandoned."""
    store, leases, claimed = await claimed_together(pool, 3)
    [row] = await claim_rows(pool)
    late = row["run_ids"][1]
    await pool.execute("UPDATE claim_leases SET deadlines[2] = now() - interval '1 second',"
                       " deadline_at = now() - interval '1 second'")
    assert await Reaper(store).sweep(leases, now()) == 1
    statuses = {r["run_id"]: r["status"] for r in await pool.fetch("SELECT run_id, status FROM runs")}
    assert statuses[late] == "scheduled"
    assert [statuses[run.run_id] for run in claimed if run.run_id != late] == ["running", "running"]
    error = await pool.fetchval("SELECT error FROM run_attempts WHERE run_id = $1", late)
    assert "ran past its deadline" in error


async def test_a_reap_holds_off_a_heartbeat_and_the_heartbeat_then_lets_the_run_go(pool: asyncpg.Pool) -> None:
    """The reaper locks the claim's row before it ends a run of it: a heartbeat arriving meanwhile
    waits, and then tells its worker that the run is gone (no second copy running unnoticed)."""
    store, leases, claimed = await claimed_together(pool, 2)
    await pool.execute("UPDATE claim_leases SET expires_at = now() - interval '1 second'")
    lost = await store.expired_runs(list(leases), 1000)
    async with open_transaction(pool) as held:
        assert len(await SchedulerStore(held, "node").reap(  # type: ignore[arg-type]
            leases, [judge(run, now()) for run in lost], now())) == 2
        heartbeat = asyncio.create_task(WorkerStore(pool, "worker-1").extend_leases(claimed, 30))
        await until_blocked_or_done(pool, heartbeat)
        assert not heartbeat.done()
    assert await heartbeat == set()


async def test_a_renewed_claim_is_not_reaped(pool: asyncpg.Pool) -> None:
    """The reaper read the claim expired; the worker, paused and not dead, renewed it before the reap."""
    store, leases, claimed = await claimed_together(pool, 2)
    await pool.execute("UPDATE claim_leases SET expires_at = now() - interval '1 second'")
    lost = [judge(run, now()) for run in await store.expired_runs(list(leases), 1000)]
    assert len(lost) == 2
    assert await WorkerStore(pool, "worker-1").extend_leases(claimed, 30) == {run.run_id for run in claimed}
    assert await store.reap(leases, lost, now()) == []
    assert await pool.fetchval("SELECT count(*) FROM runs WHERE status = 'running'") == 2


async def test_a_dead_workers_claim_row_goes_once_none_of_its_runs_runs(pool: asyncpg.Pool) -> None:
    store, leases, _ = await claimed_together(pool, 2)
    await pool.execute("UPDATE claim_leases SET expires_at = now() - interval '1 second'")
    assert await store.forget_dead_claims() == 0  # its runs still run under its token: the reaper needs it
    assert await Reaper(store).sweep(leases, now()) == 2
    assert await store.forget_dead_claims() == 1
    assert await claim_rows(pool) == []
    # A live claim stays, whatever its runs did.
    _, _, others = await claimed_together(pool, 1, node=(store, leases))
    done = Completion(others[0], Outcome.success(), now(), None)
    assert await WorkerStore(pool, "worker-1").complete([done]) == {others[0].run_id}
    assert await store.forget_dead_claims() == 0
    assert len(await claim_rows(pool)) == 1


async def test_an_outcome_deletes_the_claims_it_is_told_are_done(pool: asyncpg.Pool) -> None:
    store, leases, first = await claimed_together(pool, 1)
    _, _, second = await claimed_together(pool, 1, node=(store, leases))
    assert len(await claim_rows(pool)) == 2
    worker = WorkerStore(pool, "worker-1")
    done = [Completion(first[0], Outcome.success(), now(), None)]
    assert await worker.complete(done, forget=[first[0].lease_token]) == {first[0].run_id}
    assert [r["token"] for r in await claim_rows(pool)] == [second[0].lease_token]


async def test_a_run_given_up_is_reaped_now_and_alone(pool: asyncpg.Pool) -> None:
    """A worker that stops a run without an outcome (its cap slots lapsed) gives its lease up: the
    reaper takes it at once, while the runs claimed with it keep running under the claim's lease."""
    store, leases, claimed = await claimed_together(pool, 3)
    await WorkerStore(pool, "worker-1").give_up([claimed[0]])
    assert await Reaper(store).sweep(leases, now()) == 1
    statuses = {r["run_id"]: r["status"] for r in await pool.fetch("SELECT run_id, status FROM runs")}
    assert statuses == {claimed[0].run_id: "scheduled", claimed[1].run_id: "running", claimed[2].run_id: "running"}
    assert await pool.fetchval("SELECT count(*) FROM run_leases") == 0


async def test_a_targets_first_heartbeat_gives_its_run_a_lease_of_its_own(pool: asyncpg.Pool) -> None:
    """Any target may heartbeat with the token it was sent: from then on its lease is the run's own,
    and the claim's expiry (the worker gone) no longer ends it."""
    store, leases, claimed = await claimed_together(pool, 2)
    expires = await RunStore(pool).callback_heartbeat(claimed[0].run_id, "team-a", claimed[0].lease_token, 600)
    assert expires is not None and expires > now() + timedelta(minutes=9)
    await pool.execute("UPDATE claim_leases SET expires_at = now() - interval '1 second'")
    assert await Reaper(store).sweep(leases, now()) == 1
    assert (await pool.fetchval("SELECT status FROM runs WHERE run_id = $1", claimed[0].run_id)) == "running"


async def test_a_worker_deletes_its_claims_rows_as_their_runs_finish(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, pool: asyncpg.Pool, homes: Homes
) -> None:
    at = (now() + timedelta(seconds=1)).isoformat()
    jobs = [(await client.post("/jobs", json={"name": f"j{i}", "schedule": {"at": at},
                                               "task": {"type": "http", "url": target.url + "/ok"}})).json()["jobId"]
            for i in range(20)]

    async def all_succeeded() -> bool:
        counts = [await homes.fetchval(job, "SELECT count(*) FROM runs WHERE job_id = $1 AND status = 'succeeded'",
                                       uuid.UUID(job)) for job in jobs]
        return sum(counts) == len(jobs)

    await wait_for(all_succeeded, timeout=20, what="every run to succeed")

    async def no_claim_rows() -> bool:
        return sum([await home.fetchval("SELECT count(*) FROM claim_leases") for home in await homes.homes()]) == 0

    # Deleted with the next outcome, or by the heartbeat (every 0.5 s here) once the worker is idle.
    await wait_for(no_claim_rows, timeout=10, what="the worker to delete its claims' lease rows")
    assert sum([await home.fetchval("SELECT count(*) FROM run_leases") for home in await homes.homes()]) == 0
