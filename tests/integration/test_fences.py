"""Every fence in the SQL, each with the race it exists for, built step by step at the store.

A fence is a condition in a write (or a read) that refuses a writer who lost its right to write: a
node whose partition lease moved, a worker whose run lease moved, a batch planned from a job version
that was edited since, a caller who does not own the job. Each test here builds the exact
interleaving that fence exists for, by calling the stores in a chosen order and by moving time
through the data (a lease expiry set in the past), and fails when the fence is removed:
``python -m tests.fence_check`` removes each one in turn and proves it (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, date, datetime, timedelta

import asyncpg
import pytest

from chimes.calendars import CalendarSpec
from chimes.jobs import JobPatch
from chimes.scheduler.firing import plan_fires
from chimes.scheduler.reaper import Reaper, judge
from chimes.services.jobs import JobService
from chimes.store.audit import Actor, AuditFilter, AuditNote, list_entries, record
from chimes.store.calendars import (
    calendars_by_key,
    calendars_named,
    calendars_of_owners,
    delete_calendar,
    get_calendar,
    jobs_using_calendar,
    list_calendars,
    lock_calendar,
    missing_calendars,
    put_calendar,
)
from chimes.store.dashboard import DashboardStore
from chimes.store.runs import RunStore
from chimes.store.scheduling import SchedulerStore
from chimes.store.working import ClaimedRun, Completion, WorkerStore
from chimes.worker.tasks.common import Outcome
from tests.helpers import wait_for
from tests.integration.test_fencing import due, make_due_job, spec, stall, take_all


def now() -> datetime:
    """The node's clock, which the stores take as an argument; leases follow the database's clock."""
    return datetime.now(UTC)


# --- building blocks ---------------------------------------------------------------------------

# The two leases a running run can have (migration 0015): its claim's, shared with the runs claimed
# with it, or its own (a callback task's). The fences of the lease tests hold for both.
LEASES = pytest.mark.parametrize("callback", [False, True], ids=["claim lease", "own lease"])


async def fired_one_off(pool: asyncpg.Pool, callback: bool = False) -> tuple[SchedulerStore, dict[int, int], uuid.UUID]:
    """A one-off job of team-a, fired: its run waits in the queue. Returns the node, its leases, the job."""
    job_id = await make_due_job(pool, {"at": (now() - timedelta(seconds=1)).isoformat()}, callback)
    store = SchedulerStore(pool, "node")
    leases = await take_all(store)
    result = await store.fire(leases, plan_fires(await due(store, leases)), now())
    assert result.enqueued == 1
    return store, leases, job_id


async def running_run(pool: asyncpg.Pool, worker: str = "worker-1", callback: bool = False
                      ) -> tuple[SchedulerStore, dict[int, int], ClaimedRun]:
    store, leases, _ = await fired_one_off(pool, callback)
    [claimed] = await WorkerStore(pool, worker).claim(10, lease_sec=30, deadline_grace_sec=30)
    return store, leases, claimed


async def expire_run_lease(pool: asyncpg.Pool) -> None:
    """The worker holding the run stops heartbeating (killed, frozen, cut off): its lease runs out."""
    await pool.execute("UPDATE claim_leases SET expires_at = now() - interval '1 second'")
    await pool.execute("UPDATE run_leases SET expires_at = now() - interval '1 second'")


async def lost_and_claimed_again(pool: asyncpg.Pool, callback: bool = False) -> tuple[ClaimedRun, ClaimedRun]:
    """The race every run lease token exists for: worker-1's lease expires, the reaper re-enqueues
    the run, worker-2 claims it. Worker-1 is not dead, only late, and still holds its old token."""
    store, leases, first = await running_run(pool, "worker-1", callback)
    await expire_run_lease(pool)
    assert await Reaper(store).sweep(leases, now()) == 1
    [second] = await WorkerStore(pool, "worker-2").claim(10, lease_sec=30, deadline_grace_sec=30)
    assert second.run_id == first.run_id and second.attempt == 2 and second.lease_token != first.lease_token
    return first, second


async def run_row(pool: asyncpg.Pool, run_id: uuid.UUID) -> asyncpg.Record:
    return await pool.fetchrow("SELECT * FROM runs WHERE run_id = $1", run_id)


async def lease_row(pool: asyncpg.Pool, run_id: uuid.UUID) -> asyncpg.Record | None:
    """The lease the reaper judges the run's current attempt by: its claim's, or its own."""
    return await pool.fetchrow("SELECT l.* FROM leases_in_force l JOIN runs r ON r.run_id = l.run_id"
                               " AND r.scheduled_at = l.scheduled_at AND r.lease_token = l.token"
                               " WHERE l.run_id = $1", run_id)


async def still_with_worker_2(pool: asyncpg.Pool, second: ClaimedRun) -> None:
    """Worker-2's attempt is untouched: the run and its lease row (which the reaper reads) both."""
    run = await run_row(pool, second.run_id)
    assert (run["status"], run["worker_id"], run["lease_token"], run["attempt"]) == (
        "running", "worker-2", second.lease_token, 2)
    lease = await lease_row(pool, second.run_id)
    assert lease is not None and lease["token"] == second.lease_token
    assert await pool.fetchval("SELECT count(*) FROM run_queue") == 0


class OneConnection:
    """Stands in for a pool: every ``acquire`` hands out this one connection. Inside a transaction
    the test opened, a store's own transaction becomes a savepoint, so what it wrote stays
    uncommitted, its row locks held, until the test commits: a fire caught in the middle."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[asyncpg.Connection]:
        yield self.conn


@contextlib.asynccontextmanager
async def open_transaction(pool: asyncpg.Pool) -> AsyncIterator[OneConnection]:
    async with pool.acquire() as conn, conn.transaction():
        yield OneConnection(conn)


async def blocked_on_a_lock(pool: asyncpg.Pool) -> bool:
    return await pool.fetchval("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                               "AND wait_event_type = 'Lock'") > 0


async def until_blocked_or_done(pool: asyncpg.Pool, task: asyncio.Task) -> None:
    async def waiting() -> bool:
        return task.done() or await blocked_on_a_lock(pool)
    await wait_for(waiting, timeout=10, what="the concurrent transaction to wait on the fire's locks")


# --- partition lease: fire, retry, reap --------------------------------------------------------

async def lose_and_take_back(pool: asyncpg.Pool, a: SchedulerStore, before: dict[int, int]) -> dict[int, int]:
    """Node A, holding every partition, stalls; node B takes them over and stalls before doing
    anything; A wakes up and takes them back. A is the owner again, under a new token, while what it
    prepared before the stall (a batch, a reap) is still in flight with the old one."""
    await stall(pool, a.node_id)
    await take_all(SchedulerStore(pool, "node-b"))
    await stall(pool, "node-b")
    after = await take_all(a)
    assert all(after[p] == before[p] + 2 for p in before)
    owners = await pool.fetch("SELECT DISTINCT owner FROM partition_leases WHERE expires_at > now()")
    assert [r["owner"] for r in owners] == [a.node_id]
    return after


async def test_fire_fence_partition_token(pool: asyncpg.Pool) -> None:
    """fire_triggers: ``l.token = held.token``. The owner and the expiry are A's again; only the token
    tells that the batch was prepared under a lease that has since been replaced."""
    job_id = await make_due_job(pool)
    a = SchedulerStore(pool, "node-a")
    before = await take_all(a)
    triggers = await due(a, before)
    after = await lose_and_take_back(pool, a, before)
    stale = await a.fire(before, plan_fires(triggers), now())
    assert (stale.leases_held, stale.fired, stale.enqueued) == (0, 0, 0)
    assert await pool.fetchval("SELECT count(*) FROM runs") == 0
    fresh = await a.fire(after, plan_fires(triggers), now())
    assert (fresh.fired, fresh.enqueued) == (1, 1)
    assert await pool.fetchval("SELECT count(*) FROM runs WHERE job_id = $1", job_id) == 1


async def test_fire_fence_released_partition(pool: asyncpg.Pool) -> None:
    """fire_triggers: ``l.owner = $node_id`` and ``l.expires_at > now()``, together. A clean release (a node
    shedding partitions, or leaving) keeps the token: only the owner and the expiry it clears refuse a
    batch the node prepared before it let the partition go. Either of the two is enough."""
    await make_due_job(pool)
    a = SchedulerStore(pool, "node-a")
    leases = await take_all(a)
    triggers = await due(a, leases)
    await a.leave()
    stale = await a.fire(leases, plan_fires(triggers), now())
    assert (stale.leases_held, stale.fired, stale.enqueued) == (0, 0, 0)
    assert await pool.fetchval("SELECT count(*) FROM runs") == 0
    assert await pool.fetchval("SELECT count(*) FROM triggers") == 1


async def test_fire_fence_a_token_issued_again_to_another_node(pool: asyncpg.Pool) -> None:
    """fire_triggers: ``l.owner = $node_id`` on its own. Node A takes its partitions; the primary that
    granted them is lost before its standby received the grant (asynchronous replication), the standby
    is promoted with the tokens one lower, and node B takes the partitions there: the same token
    numbers A holds, now B's and unexpired. Only the owner refuses A's batch."""
    await make_due_job(pool)
    a = SchedulerStore(pool, "node-a")
    held = await take_all(a)
    triggers = await due(a, held)
    # What the promoted standby holds once node B has acquired: A's grant lost, B's bump to the same number.
    await pool.execute("UPDATE partition_leases SET owner = 'node-b', expires_at = now() + interval '30 seconds'")
    assert await pool.fetchval("SELECT count(*) FROM partition_leases l JOIN unnest($1::smallint[], $2::bigint[]) "
                               "AS h(p, token) ON l.partition_id = h.p AND l.token = h.token",
                               list(held), list(held.values())) == len(held)
    stale = await a.fire(held, plan_fires(triggers), now())
    assert (stale.leases_held, stale.fired, stale.enqueued) == (0, 0, 0)
    assert await pool.fetchval("SELECT count(*) FROM runs") == 0


async def test_retry_fence_partition_token(pool: asyncpg.Pool) -> None:
    """fire_triggers, for a retry trigger: a node whose lease moved does not re-enqueue the run."""
    _, _, claimed = await running_run(pool)
    failed = Completion(claimed, Outcome.failure("HTTP 500"), now(), now() - timedelta(seconds=1))
    assert await WorkerStore(pool, "worker-1").complete([failed]) == {claimed.run_id}
    await stall(pool, "node")
    a = SchedulerStore(pool, "node-a")
    before = await take_all(a)
    [retry] = await due(a, before)
    after = await lose_and_take_back(pool, a, before)
    assert retry.kind == 1 and retry.trigger_id == claimed.run_id
    stale = await a.fire(before, plan_fires([retry]), now())
    assert (stale.leases_held, stale.fired, stale.enqueued) == (0, 0, 0)
    assert await pool.fetchval("SELECT count(*) FROM run_queue") == 0
    fresh = await a.fire(after, plan_fires([retry]), now())
    assert (fresh.fired, fresh.enqueued) == (1, 1)


async def test_reap_fence_partition_token(pool: asyncpg.Pool) -> None:
    """reap_runs: ``l.token = held.token``. A reads the expired runs, stalls, loses its partitions and
    takes them back: the reap it prepared before is refused; its next sweep, under the new token,
    reaps. (The run's own lease token and expiry would keep this reap's outcome right; the partition
    token keeps the promise that a node writes only where it holds the lease it read under.)"""
    _, _, claimed = await running_run(pool)
    await expire_run_lease(pool)
    await stall(pool, "node")
    a = SchedulerStore(pool, "node-a")
    before = await take_all(a)
    lost = [judge(r, now()) for r in await a.expired_runs(list(before), 1000)]
    assert [r.run_id for r in lost] == [claimed.run_id]
    after = await lose_and_take_back(pool, a, before)
    assert await a.reap(before, lost, now()) == []
    assert (await run_row(pool, claimed.run_id))["status"] == "running"
    assert [r["run_id"] for r in await a.reap(after, lost, now())] == [claimed.run_id]


async def test_reap_fence_released_partition(pool: asyncpg.Pool) -> None:
    """reap_runs: ``l.owner = $node_id`` and ``l.expires_at > now()``, together: after a clean release
    (token kept), the node's pending reap is refused; the partition's next owner reaps."""
    store, leases, claimed = await running_run(pool)
    await expire_run_lease(pool)
    lost = [judge(r, now()) for r in await store.expired_runs(list(leases), 1000)]
    await store.leave()
    assert await store.reap(leases, lost, now()) == []
    assert (await run_row(pool, claimed.run_id))["status"] == "running"
    other = SchedulerStore(pool, "node-b")
    assert await Reaper(other).sweep(await take_all(other), now()) == 1


async def test_release_leases_fence_owner(pool: asyncpg.Pool) -> None:
    """release_leases: ``owner = $1``. A node that stalled and lost its partitions leaves: it gives
    back only what is its own, not the partitions node B now holds."""
    a = SchedulerStore(pool, "node-a")
    await take_all(a)
    await stall(pool, "node-a")
    b = SchedulerStore(pool, "node-b")
    held = await take_all(b)
    await a.leave()  # it owns nothing any more
    assert await pool.fetchval("SELECT count(*) FROM partition_leases WHERE owner = 'node-b' "
                               "AND expires_at > now()") == 1024
    assert (await b.sync_leases("host", 1, held, ttl_sec=30)).held == held  # renewed, same tokens


# --- job version: fire -------------------------------------------------------------------------

async def test_fire_fence_trigger_version(pool: asyncpg.Pool) -> None:
    """fire_triggers: ``t.job_version = d.job_version``. The node read the trigger ahead of its time
    (the look-ahead); an edit of what a fire reads that keeps the slot rewrites it under the same key
    at version 2. The batch of version 1 must leave it alone: without the fence it deletes the new
    trigger, makes no run (the job's plan is at version 2) and does not advance it, and the job never
    fires again."""
    created = await JobService(pool).create("team-a", spec({"cron": "0 0 1 1 *"}), now())
    store = SchedulerStore(pool, "node")
    leases = await take_all(store)
    [trigger] = await store.scan_due(list(leases), created.next_run_at + timedelta(seconds=1), 1000)
    await JobService(pool).update(created.job_id, None, JobPatch(catchUp={"policy": "none"}), now())
    [rewritten] = await pool.fetch("SELECT * FROM triggers WHERE job_id = $1", created.job_id)
    assert (rewritten["fire_at"], rewritten["job_version"]) == (trigger.fire_at, 2)
    # Both moved to a time that has come (the node fires nothing before the database's clock says so).
    trigger = replace(trigger, fire_at=await made_due(pool, created.job_id, trigger.fire_at))
    stale = await store.fire(leases, plan_fires([trigger], now()), now())
    assert stale.fired == 0
    assert [r["job_version"] for r in await pool.fetch("SELECT * FROM triggers WHERE job_id = $1",
                                                       created.job_id)] == [2]


async def made_due(pool: asyncpg.Pool, job_id: uuid.UUID, fire_at: datetime) -> datetime:
    """Move the job's trigger at ``fire_at`` (a time to come) to two minutes ago, where the database's
    clock lets it fire (fire_triggers fires nothing before its time); returns its new time."""
    earlier = await pool.fetchval("SELECT date_trunc('second', clock_timestamp()) - interval '2 minutes'")
    moved = await pool.execute("UPDATE triggers SET fire_at = $3 WHERE job_id = $1 AND fire_at = $2",
                               job_id, fire_at, earlier)
    assert moved == "UPDATE 1"
    return earlier


async def fire_caught_mid_transaction(
    pool: asyncpg.Pool, patch: JobPatch
) -> tuple[SchedulerStore, dict[int, int], uuid.UUID, datetime]:
    """An edit races a fire of the same job: the fire has deleted the due trigger and written the
    next one, not yet committed, when the edit deletes the job's triggers. The edit waits for the
    fire's lock on the old trigger, and its delete never sees the fire's new one. Returns the job and
    the next fire time the fire wrote (at version 1), with the node and its leases."""
    job_id = await make_due_job(pool)
    store = SchedulerStore(pool, "node")
    leases = await take_all(store)
    triggers = await due(store, leases)
    [fire] = plan_fires(triggers, now())
    async with open_transaction(pool) as held:
        result = await SchedulerStore(held, "node").fire(leases, [fire], now())  # type: ignore[arg-type]
        assert (result.fired, result.enqueued) == (1, 1)
        # The edit computes the job's next fire from the slot just fired, as the fire did: with the
        # clock's now, a minute boundary passing in between would give the two triggers different keys.
        edit = asyncio.create_task(JobService(pool).update(job_id, None, patch, fire.scheduled_at))
        await until_blocked_or_done(pool, edit)
    edited = await edit
    assert edited is not None and edited.version == 2
    return store, leases, job_id, fire.next_fire_at


async def test_fire_fence_job_version(pool: asyncpg.Pool) -> None:
    """fire_triggers: ``f.job_version >= coalesce(j.plan_version, j.version)``. An edit that moves the
    schedule, racing a fire, waits for the fire and replaces the next trigger it wrote. A trigger of
    the old definition left beside the edit's own all the same (a release before the edit read it
    again) passes the trigger's version check, its version matching the batch that read it; only the
    job's plan version refuses to make a run of the old definition from it."""
    store, leases, job_id, stale_at = await fire_caught_mid_transaction(
        pool, JobPatch(schedule={"cron": "0 0 1 1 *"}))
    versions = {r["fire_at"]: r["job_version"] for r in await pool.fetch(
        "SELECT fire_at, job_version FROM triggers WHERE job_id = $1", job_id)}
    assert stale_at not in versions and sorted(versions.values()) == [2]  # the edit saw the fire's next one
    await pool.execute("INSERT INTO triggers (partition_id, fire_at, trigger_id, job_id, job_version, kind) "
                       "SELECT partition_id, $2, trigger_id, job_id, 1, 0 FROM triggers WHERE job_id = $1",
                       job_id, stale_at)
    stale_at = await made_due(pool, job_id, stale_at)
    stale = [t for t in await store.scan_due(list(leases), stale_at + timedelta(seconds=1), 1000)
             if t.fire_at == stale_at]
    assert stale and stale[0].job_version == 1
    await store.fire(leases, plan_fires(stale, now()), now())
    assert await pool.fetchval("SELECT count(*) FROM runs WHERE job_id = $1", job_id) == 1  # the first fire's
    assert [r["job_version"] for r in await pool.fetch("SELECT job_version FROM triggers WHERE job_id = $1",
                                                       job_id)] == [2]


async def test_edit_racing_a_fire_keeps_the_job_scheduled(pool: asyncpg.Pool) -> None:
    """The same race with an edit that keeps the schedule: the trigger the fire wrote stays, and
    fires the next slot. (An edit that rewrote it used to lose it to ``ON CONFLICT DO NOTHING``,
    leaving a version-1 trigger that then fired nothing and went away: the job never fired again.)"""
    store, leases, job_id, next_at = await fire_caught_mid_transaction(pool, JobPatch(name="renamed"))
    [trigger] = await pool.fetch("SELECT * FROM triggers WHERE job_id = $1", job_id)
    assert (trigger["fire_at"], trigger["job_version"]) == (next_at, 1)
    next_at = await made_due(pool, job_id, next_at)
    [due_next] = await store.scan_due(list(leases), next_at + timedelta(seconds=1), 1000)
    result = await store.fire(leases, plan_fires([due_next], now()), now())
    assert result.fired == 1  # (skipped: the first run is still waiting, and the job's concurrency is skip)
    assert await pool.fetchval("SELECT job_version FROM runs WHERE scheduled_at = $1", next_at) == 2
    assert await pool.fetchval("SELECT count(*) FROM triggers WHERE job_id = $1", job_id) == 1


# --- run lease: complete, extend, release, reap, claim -----------------------------------------

@LEASES
async def test_complete_fence_run_lease_token(pool: asyncpg.Pool, callback: bool) -> None:
    """complete_runs: ``r.lease_token = o.lease_token`` for the run, ``l.token = o.lease_token`` for its
    lease row. Worker-1 reports after worker-2 claimed the run again: refused, whatever it reports;
    worker-2's attempt is untouched and its outcome counts."""
    first, second = await lost_and_claimed_again(pool, callback)
    late = Completion(first, Outcome.success("worker-1's answer"), now(), None)
    assert await WorkerStore(pool, "worker-1").complete([late]) == set()
    await still_with_worker_2(pool, second)
    assert await pool.fetchval("SELECT count(*) FROM run_attempts") == 1  # the reaped attempt 1 only
    done = Completion(second, Outcome.success("worker-2's answer"), now(), None)
    assert await WorkerStore(pool, "worker-2").complete([done]) == {second.run_id}
    attempts = await pool.fetch("SELECT attempt, worker_id, status, output FROM run_attempt_history ORDER BY attempt")
    assert [tuple(a.values()) for a in attempts] == [
        (1, "worker-1", "failed", None), (2, "worker-2", "succeeded", "worker-2's answer")]


@LEASES
async def test_complete_fence_run_lease_token_for_a_retry(pool: asyncpg.Pool, callback: bool) -> None:
    """complete_runs, a failure with attempts left: refused too, so no retry trigger is written and
    the attempt is not raised under worker-2's feet."""
    first, second = await lost_and_claimed_again(pool, callback)
    late = Completion(first, Outcome.failure("HTTP 500"), now(), now())
    assert await WorkerStore(pool, "worker-1").complete([late]) == set()
    await still_with_worker_2(pool, second)
    assert await pool.fetchval("SELECT count(*) FROM triggers WHERE kind = 1") == 0


@LEASES
async def test_extend_fence_run_lease_token(pool: asyncpg.Pool, callback: bool) -> None:
    """extend_leases: ``l.token = held.lease_token``. Worker-1's heartbeat must not keep worker-2's
    lease alive, and must tell worker-1 that the run is gone, so it stops its task."""
    first, second = await lost_and_claimed_again(pool, callback)
    expires = (await lease_row(pool, second.run_id))["expires_at"]
    assert await WorkerStore(pool, "worker-1").extend_leases([first], 3600) == set()
    assert (await lease_row(pool, second.run_id))["expires_at"] == expires
    await still_with_worker_2(pool, second)


@LEASES
async def test_release_fence_run_lease_token(pool: asyncpg.Pool, callback: bool) -> None:
    """release_runs: ``r.lease_token = held.lease_token`` for the run, ``l.token = held.lease_token``
    for its lease row. Worker-1 shutting down hands back only what it holds: not worker-2's run,
    which would be queued again and run twice at once, nor its lease."""
    first, second = await lost_and_claimed_again(pool, callback)
    assert await WorkerStore(pool, "worker-1").release([first]) == set()
    await still_with_worker_2(pool, second)


@LEASES
async def test_reap_fence_run_lease_token(pool: asyncpg.Pool, callback: bool) -> None:
    """reap_runs: ``l.token = d.lease_token``. The reaper judged worker-1's expired attempt and
    stalled; meanwhile worker-1 handed the run back, worker-2 claimed it and died too. The stale
    judgement (worker-1's attempt, worker-1's start) must not end worker-2's attempt nor take its
    lease row; the next sweep judges that attempt itself."""
    store, leases, first = await running_run(pool, "worker-1", callback)
    await expire_run_lease(pool)
    lost = [judge(r, now()) for r in await store.expired_runs(list(leases), 1000)]
    assert await WorkerStore(pool, "worker-1").release([first]) == {first.run_id}
    [second] = await WorkerStore(pool, "worker-2").claim(10, lease_sec=30, deadline_grace_sec=30)
    await expire_run_lease(pool)
    assert await store.reap(leases, lost, now()) == []
    assert (await run_row(pool, second.run_id))["lease_token"] == second.lease_token
    assert (await lease_row(pool, second.run_id))["token"] == second.lease_token
    assert await Reaper(store).sweep(leases, now()) == 1
    [attempt] = await pool.fetch("SELECT * FROM run_attempts")
    assert attempt["worker_id"] == "worker-2" and "worker worker-2 stopped heartbeating" in attempt["error"]


@LEASES
async def test_reap_fence_lease_still_expired(pool: asyncpg.Pool, callback: bool) -> None:
    """reap_runs: ``(l.expires_at < now() OR l.deadline_at < now())``. The reaper read an
    expired lease; before it wrote, the worker (paused, not dead) heartbeat and renewed it under the
    same token. The reap must be refused, or the run is queued again while worker-1 still runs it."""
    store, leases, first = await running_run(pool, "worker-1", callback)
    await expire_run_lease(pool)
    lost = [judge(r, now()) for r in await store.expired_runs(list(leases), 1000)]
    assert await WorkerStore(pool, "worker-1").extend_leases([first], 30) == {first.run_id}
    assert await store.reap(leases, lost, now()) == []
    run = await run_row(pool, first.run_id)
    assert (run["status"], run["lease_token"]) == ("running", first.lease_token)
    assert (await lease_row(pool, first.run_id))["token"] == first.lease_token
    assert await pool.fetchval("SELECT count(*) FROM run_queue") == 0


async def test_claim_fence_run_still_scheduled(pool: asyncpg.Pool) -> None:
    """claim_runs: ``r.status = 'scheduled'``. A cancel races the fire of a retry trigger:
    the fire read the run as waiting and queues it; the cancel, waiting on the fire's lock on the
    trigger, does not see that queue row. The run is cancelled with a queue row left behind, and a
    worker claiming that row must not start it."""
    store, leases, claimed = await running_run(pool)
    failed = Completion(claimed, Outcome.failure("HTTP 500"), now(), now() - timedelta(seconds=1))
    assert await WorkerStore(pool, "worker-1").complete([failed]) == {claimed.run_id}
    [retry] = await due(store, leases)
    async with open_transaction(pool) as held:
        result = await SchedulerStore(held, "node").fire(leases, plan_fires([retry]), now())  # type: ignore[arg-type]
        assert result.enqueued == 1
        cancel = asyncio.create_task(RunStore(pool).cancel(claimed.run_id, None, "cancelled by team-a"))
        await until_blocked_or_done(pool, cancel)
    assert await cancel
    assert await pool.fetchval("SELECT count(*) FROM run_queue") == 1  # the race's leftover
    assert await WorkerStore(pool, "worker-2").claim(10, lease_sec=30, deadline_grace_sec=30) == []
    run = await run_row(pool, claimed.run_id)
    assert (run["status"], run["worker_id"], run["lease_token"]) == ("cancelled", None, None)
    assert await pool.fetchval("SELECT count(*) FROM run_queue") == 0
    # worker-2's claim got nothing and wrote no lease; worker-1's claim keeps its row until it is forgotten
    assert await pool.fetchval("SELECT count(*) FROM run_leases") == 0
    assert [r["token"] for r in await pool.fetch("SELECT token FROM claim_leases")] == [claimed.lease_token]


async def test_claim_a_run_queued_twice_starts_it_once(pool: asyncpg.Pool) -> None:
    """claim_runs: ``r.status = 'scheduled'`` again. The queue has no index on run_id (migration
    0014) and nothing queues a run twice; were it ever, the run starts once, under one lease, in the
    same claim or in the next, and the second row goes with the claim that reads it."""
    store, leases, _ = await fired_one_off(pool)
    await pool.execute("INSERT INTO run_queue (tier, run_id, scheduled_at, job_id) "
                       "SELECT tier, run_id, scheduled_at, job_id FROM run_queue")
    assert await pool.fetchval("SELECT count(*) FROM run_queue") == 2
    [claimed] = await WorkerStore(pool, "worker-1").claim(10, lease_sec=30, deadline_grace_sec=30)
    assert await pool.fetchval("SELECT count(*) FROM run_queue") == 0
    assert [r["token"] for r in await pool.fetch("SELECT token FROM leases_in_force")] == [claimed.lease_token]
    assert (await run_row(pool, claimed.run_id))["lease_token"] == claimed.lease_token

    await make_due_job(pool, {"at": (now() - timedelta(seconds=1)).isoformat()})
    assert (await store.fire(leases, plan_fires(await due(store, leases)), now())).enqueued == 1
    await pool.execute("INSERT INTO run_queue (tier, run_id, scheduled_at, job_id) "
                       "SELECT tier, run_id, scheduled_at, job_id FROM run_queue")
    [first] = await WorkerStore(pool, "worker-1").claim(1, lease_sec=30, deadline_grace_sec=30)
    assert await WorkerStore(pool, "worker-2").claim(1, lease_sec=30, deadline_grace_sec=30) == []
    assert await pool.fetchval("SELECT count(*) FROM run_queue") == 0
    assert (await run_row(pool, first.run_id))["worker_id"] == "worker-1"


# --- run lease: the callbacks of asynchronous tasks --------------------------------------------

@LEASES
async def test_callback_heartbeat_fence_run_lease_token(pool: asyncpg.Pool, callback: bool) -> None:
    """callback_heartbeat: ``l.token = $4``. The target of attempt 1 heartbeats after the run was
    reaped and claimed again: refused (409), and worker-2's lease is not extended by it."""
    first, second = await lost_and_claimed_again(pool, callback)
    expires = (await lease_row(pool, second.run_id))["expires_at"]
    assert await RunStore(pool).callback_heartbeat(first.run_id, "team-a", first.lease_token, 3600) is None
    assert (await lease_row(pool, second.run_id))["expires_at"] == expires
    assert await RunStore(pool).callback_heartbeat(second.run_id, "team-a", second.lease_token, 30) is not None


@LEASES
async def test_callback_complete_fence_run_lease_token(pool: asyncpg.Pool, callback: bool) -> None:
    """The complete callback of attempt 1, after the run was claimed again: refused (409)."""
    first, second = await lost_and_claimed_again(pool, callback)
    assert not await RunStore(pool).callback_complete(first.run_id, "team-a", first.lease_token, "succeeded",
                                                      None, None, now())
    await still_with_worker_2(pool, second)
    assert await RunStore(pool).callback_complete(second.run_id, "team-a", second.lease_token, "succeeded",
                                                  None, None, now())


# --- owner: every read and write of a job or run -----------------------------------------------

async def team_a_job_with_run(pool: asyncpg.Pool) -> tuple[uuid.UUID, uuid.UUID]:
    """A recurring job of team-a with one run (queued). Returns (job id, run id)."""
    job_id = await make_due_job(pool)
    store = SchedulerStore(pool, "node")
    leases = await take_all(store)
    assert (await store.fire(leases, plan_fires(await due(store, leases)), now())).enqueued == 1
    return job_id, await pool.fetchval("SELECT run_id FROM runs WHERE job_id = $1", job_id)


async def test_owner_fence_get_job(pool: asyncpg.Pool) -> None:
    job_id, _ = await team_a_job_with_run(pool)
    assert await JobService(pool).get(job_id, "team-b") is None
    assert await JobService(pool).get(job_id, "team-a") is not None


async def test_owner_fence_list_jobs(pool: asyncpg.Pool) -> None:
    await team_a_job_with_run(pool)
    assert await JobService(pool).list("team-b", None, 100) == []
    assert len(await JobService(pool).list("team-a", None, 100)) == 1


async def test_owner_fence_lock_job(pool: asyncpg.Pool) -> None:
    """lock_job: an update (edit, pause, resume) by another team finds nothing and changes nothing."""
    job_id, _ = await team_a_job_with_run(pool)
    assert await JobService(pool).update(job_id, "team-b", JobPatch(paused=True), now()) is None
    assert await pool.fetchrow("SELECT version, paused FROM jobs") == (1, False)


async def test_owner_fence_delete_job(pool: asyncpg.Pool) -> None:
    job_id, _ = await team_a_job_with_run(pool)
    assert not await JobService(pool).delete(job_id, "team-b")
    assert await pool.fetchval("SELECT count(*) FROM jobs") == 1
    assert await pool.fetchval("SELECT count(*) FROM triggers WHERE kind = 0") == 1


async def test_owner_fence_idempotency_key(pool: asyncpg.Pool) -> None:
    """job_by_idempotency_key: keys are per owner. Team-b repeating a create with a key team-a also
    used gets its own job back, never team-a's."""
    jobs = JobService(pool)
    body = spec({"cron": "* * * * *"})
    a = await jobs.create("team-a", body, now(), idempotency_key="nightly")
    b = await jobs.create("team-b", body, now(), idempotency_key="nightly")
    assert b.created and b.job_id != a.job_id
    again = await jobs.create("team-b", body, now(), idempotency_key="nightly")
    assert (again.job_id, again.created) == (b.job_id, False)


async def test_owner_fence_job_owner(pool: asyncpg.Pool) -> None:
    job_id, _ = await team_a_job_with_run(pool)
    assert not await RunStore(pool).job_visible(job_id, "team-b")
    assert await RunStore(pool).job_visible(job_id, "team-a")


async def test_owner_fence_list_runs(pool: asyncpg.Pool) -> None:
    job_id, _ = await team_a_job_with_run(pool)
    assert await RunStore(pool).list(job_id, "team-b", None, None, 100) == []
    assert len(await RunStore(pool).list(job_id, "team-a", None, None, 100)) == 1


async def test_owner_fence_get_run(pool: asyncpg.Pool) -> None:
    _, run_id = await team_a_job_with_run(pool)
    assert await RunStore(pool).get(run_id, "team-b") is None
    assert await RunStore(pool).get(run_id, "team-a") is not None


async def test_owner_fence_start_run_now(pool: asyncpg.Pool) -> None:
    job_id, _ = await team_a_job_with_run(pool)
    assert await RunStore(pool).start_now(job_id, "team-b", "manual", now()) is None
    assert await pool.fetchval("SELECT count(*) FROM runs") == 1


async def test_owner_fence_cancel_run(pool: asyncpg.Pool) -> None:
    _, run_id = await team_a_job_with_run(pool)
    assert not await RunStore(pool).cancel(run_id, "team-b", "cancelled by team-b")
    assert await pool.fetchval("SELECT status FROM runs") == "scheduled"
    assert await pool.fetchval("SELECT count(*) FROM run_queue") == 1


async def test_owner_fence_backfill(pool: asyncpg.Pool) -> None:
    job_id, _ = await team_a_job_with_run(pool)
    end = now() - timedelta(hours=1)
    assert await RunStore(pool).backfill(job_id, "team-b", end - timedelta(minutes=10), end, 100) is None
    assert await pool.fetchval("SELECT count(*) FROM runs") == 1


@LEASES
async def test_owner_fence_callback_heartbeat(pool: asyncpg.Pool, callback: bool) -> None:
    """callback_heartbeat and callback_own_lease: the right lease token presented by another team is refused."""
    _, _, claimed = await running_run(pool, callback=callback)
    expires = (await lease_row(pool, claimed.run_id))["expires_at"]
    assert await RunStore(pool).callback_heartbeat(claimed.run_id, "team-b", claimed.lease_token, 3600) is None
    assert (await lease_row(pool, claimed.run_id))["expires_at"] == expires


async def test_owner_fence_callback_complete(pool: asyncpg.Pool) -> None:
    """running_with_token: the complete callback with the right token from another team is refused
    (complete_runs itself has no owner: this read is the only check)."""
    _, _, claimed = await running_run(pool)
    assert not await RunStore(pool).callback_complete(claimed.run_id, "team-b", claimed.lease_token, "succeeded",
                                                      None, None, now())
    assert (await run_row(pool, claimed.run_id))["status"] == "running"


async def test_owner_fence_dashboard_jobs(pool: asyncpg.Pool) -> None:
    await team_a_job_with_run(pool)
    assert (await DashboardStore(pool).jobs("team-b", "", "all", None, 50)).jobs == []
    assert len((await DashboardStore(pool).jobs("team-a", "", "all", None, 50)).jobs) == 1


async def test_owner_fence_dashboard_paused_jobs(pool: asyncpg.Pool) -> None:
    job_id, _ = await team_a_job_with_run(pool)
    await JobService(pool).update(job_id, "team-a", JobPatch(paused=True), now())
    assert (await DashboardStore(pool).jobs("team-b", "", "paused", None, 50)).jobs == []
    assert len((await DashboardStore(pool).jobs("team-a", "", "paused", None, 50)).jobs) == 1


async def failed_run_of_team_a(pool: asyncpg.Pool) -> None:
    _, _, claimed = await running_run(pool)
    failed = Completion(claimed, Outcome.failure("HTTP 500"), now(), None)
    assert await WorkerStore(pool, "worker-1").complete([failed]) == {claimed.run_id}


async def test_owner_fence_dashboard_failing_jobs(pool: asyncpg.Pool) -> None:
    await failed_run_of_team_a(pool)
    assert (await DashboardStore(pool).jobs("team-b", "", "failing", None, 50)).jobs == []
    assert len((await DashboardStore(pool).jobs("team-a", "", "failing", None, 50)).jobs) == 1


async def test_owner_fence_dashboard_running_runs(pool: asyncpg.Pool) -> None:
    await running_run(pool)
    assert (await DashboardStore(pool).fleet("team-b", now(), timedelta(minutes=5), 30)).running == []
    assert len((await DashboardStore(pool).fleet("team-a", now(), timedelta(minutes=5), 30)).running) == 1


async def test_owner_fence_dashboard_failures_per_minute(pool: asyncpg.Pool) -> None:
    await failed_run_of_team_a(pool)
    assert (await DashboardStore(pool).fleet("team-b", now(), timedelta(minutes=5), 30)).failures == []
    assert len((await DashboardStore(pool).fleet("team-a", now(), timedelta(minutes=5), 30)).failures) == 1



# --- owner: calendars and the audit trail -------------------------------------------------------

async def holidays_of_team_a(pool: asyncpg.Pool) -> None:
    await put_calendar(pool, "team-a", "holidays", CalendarSpec(dates=[date(2026, 12, 25)]))


async def test_owner_fence_get_calendar(pool: asyncpg.Pool) -> None:
    await holidays_of_team_a(pool)
    assert await get_calendar(pool, "team-b", "holidays") is None
    assert await get_calendar(pool, "team-a", "holidays") is not None


async def test_owner_fence_list_calendars(pool: asyncpg.Pool) -> None:
    await holidays_of_team_a(pool)
    assert await list_calendars(pool, "team-b") == []
    assert len(await list_calendars(pool, "team-a")) == 1


async def test_owner_fence_calendars_of_owners(pool: asyncpg.Pool) -> None:
    """What previews and nextRunAt exclude by: a job of team-b naming "holidays" is not given team-a's."""
    await holidays_of_team_a(pool)
    assert await calendars_of_owners(pool, ["team-b"]) == {}
    [named] = await calendars_named(pool, "team-b", ["holidays"])
    assert named.problem == "not found"
    assert set(await calendars_of_owners(pool, ["team-a"])) == {("team-a", "holidays")}


async def test_owner_fence_calendars_by_key(pool: asyncpg.Pool) -> None:
    """What scheduler nodes read: team-b's key does not bring team-a's calendar of that name."""
    await holidays_of_team_a(pool)
    assert await calendars_by_key(pool, [("team-b", "holidays")]) == {}
    assert set(await calendars_by_key(pool, [("team-a", "holidays")])) == {("team-a", "holidays")}


async def test_owner_fence_delete_calendar(pool: asyncpg.Pool) -> None:
    await holidays_of_team_a(pool)
    async with pool.acquire() as conn:
        assert not await delete_calendar(conn, "team-b", "holidays")
    assert await pool.fetchval("SELECT count(*) FROM calendars") == 1


async def test_owner_fence_lock_calendar(pool: asyncpg.Pool) -> None:
    """A delete by team-b of its "holidays" finds none (404), not team-a's."""
    await holidays_of_team_a(pool)
    async with pool.acquire() as conn, conn.transaction():
        assert not await lock_calendar(conn, "team-b", "holidays")


async def test_owner_fence_missing_calendars(pool: asyncpg.Pool) -> None:
    """A job of team-b cannot name team-a's calendar."""
    await holidays_of_team_a(pool)
    async with pool.acquire() as conn, conn.transaction():
        assert await missing_calendars(conn, "team-b", ["holidays"]) == ["holidays"]
        assert await missing_calendars(conn, "team-a", ["holidays"]) == []


async def test_owner_fence_share_calendars(pool: asyncpg.Pool) -> None:
    """A job of team-b being written that names "holidays" locks team-b's calendars of that name, not
    team-a's: team-a's delete of its own does not wait for team-b's write."""
    await holidays_of_team_a(pool)
    async with pool.acquire() as team_b, pool.acquire() as team_a:
        writing = team_b.transaction()
        await writing.start()
        await missing_calendars(team_b, "team-b", ["holidays"])
        deleting = team_a.transaction()
        await deleting.start()
        locking = asyncio.create_task(lock_calendar(team_a, "team-a", "holidays"))
        await until_blocked_or_done(pool, locking)
        waited = not locking.done()
        await writing.rollback()
        assert await locking
        await deleting.rollback()
    assert not waited, "team-b's job being written held team-a's calendar"


async def test_owner_fence_jobs_using_calendar(pool: asyncpg.Pool) -> None:
    """Team-b's job naming its own "holidays" neither refuses nor is listed in team-a's delete of its own."""
    await holidays_of_team_a(pool)
    await put_calendar(pool, "team-b", "holidays", CalendarSpec())
    made = await JobService(pool).create("team-b", spec({"cron": "0 2 * * *", "excludeCalendars": ["holidays"]}), now())
    assert await jobs_using_calendar(pool, "team-a", "holidays", 20) == []
    assert await jobs_using_calendar(pool, "team-b", "holidays", 20) == [made.job_id]


async def audited(pool: asyncpg.Pool, owner: str | None) -> list[str]:
    """The actions of the audit entries an owner's token lists (an admin's: None)."""
    async with pool.acquire() as conn:
        return [e.action for e in await list_entries(conn, AuditFilter(subject_owner=owner), None, 50)]


async def test_owner_fence_audit_entries(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        await record(conn, AuditNote(Actor("team-a"), now()), "calendar.put", "calendar holidays", None, {"dates": []},
                     subject_owner="team-a")
    assert await audited(pool, "team-b") == []
    assert await audited(pool, "team-a") == ["calendar.put"]


async def test_owner_fence_audit_entries_of_operators(pool: asyncpg.Pool) -> None:
    """An operator's change of team-a's settings is about team-a but stays the admins' to list: an
    owner's token sees the entries of its jobs and calendars only."""
    job_id, _ = await team_a_job_with_run(pool)
    admin = AuditNote(Actor("admin"), now())
    async with pool.acquire() as conn:
        await record(conn, admin, "owner.update", "owner team-a", {"jobQuota": None}, {"jobQuota": 5},
                     subject_owner="team-a")
        await record(conn, admin, "job.pause", f"job {job_id}", {"paused": False}, {"paused": True}, job_id=job_id)
        await record(conn, admin, "calendar.put", "calendar holidays", None, {"dates": []}, subject_owner="team-a")
    assert sorted(await audited(pool, "team-a")) == ["calendar.put", "job.pause"]
    assert sorted(await audited(pool, None)) == ["calendar.put", "job.pause", "owner.update"]


async def due_in(pool: asyncpg.Pool, run_id: uuid.UUID) -> float:
    """Seconds until the run's retry trigger is due, by the database's clock."""
    seconds: float = await pool.fetchval(
        "SELECT extract(epoch FROM fire_at - now()) FROM triggers WHERE trigger_id = $1", run_id)
    return seconds


async def test_a_worker_with_a_fast_clock_does_not_delay_retries(pool: asyncpg.Pool) -> None:
    """A worker plans a retry by its own clock, but the database's clock, which judges every trigger,
    decides when it is due: a host an hour ahead (a lost time server) would otherwise push every
    retry it plans an hour late. The backoff the worker chose is kept, counted from the database's
    now()."""
    _, _, claimed = await running_run(pool)
    fast = now() + timedelta(hours=1)
    failed = Completion(claimed, Outcome.failure("HTTP 500"), fast, fast + timedelta(seconds=2))
    assert await WorkerStore(pool, "worker-1").complete([failed]) == {claimed.run_id}
    assert 1.0 < await due_in(pool, claimed.run_id) <= 2.0


async def test_a_node_with_a_fast_clock_does_not_delay_retries(pool: asyncpg.Pool) -> None:
    """The same for the reaper: the retry of a run that ran past its deadline waits the backoff the
    node chose, by the database's clock, not an hour more."""
    store, leases, claimed = await running_run(pool)
    await expire_run_lease(pool)
    fast = now() + timedelta(hours=1)
    [lost] = [judge(r, fast) for r in await store.expired_runs(list(leases), 1000)]
    reaped = await store.reap(leases, [replace(lost, retry_at=fast + timedelta(seconds=3))], fast)
    assert [r["run_id"] for r in reaped] == [claimed.run_id]
    assert 2.0 < await due_in(pool, claimed.run_id) <= 3.0


async def test_a_worker_with_a_skewed_clock_keeps_its_attempt_within_the_database_s_time(pool: asyncpg.Pool) -> None:
    """An attempt's start is the database's time of the claim; its end is what the worker reports, by
    its own clock. A worker 2 s ahead made attempt 1 end after attempt 2 had started (the chaos run
    with one zone's clock ahead found thousands); one 2 s behind, end before it began. The reported
    end is kept between the attempt's start and the database's now()."""
    _, _, claimed = await running_run(pool)
    ahead = Completion(claimed, Outcome.failure("HTTP 500"), now() + timedelta(seconds=2), now() + timedelta(seconds=2))
    assert await WorkerStore(pool, "worker-1").complete([ahead]) == {claimed.run_id}
    [first] = await pool.fetch("SELECT started_at, finished_at FROM run_attempts WHERE run_id = $1", claimed.run_id)
    assert first["finished_at"] <= await pool.fetchval("SELECT now()")

    # The retry is due: its trigger fires (here by hand, as the node would), the run waits in the queue.
    await pool.execute("DELETE FROM triggers WHERE trigger_id = $1", claimed.run_id)
    await pool.execute("INSERT INTO run_queue (tier, run_id, scheduled_at, job_id) SELECT priority, run_id, "
                       "scheduled_at, job_id FROM runs WHERE run_id = $1", claimed.run_id)
    [second] = await WorkerStore(pool, "worker-2").claim(10, lease_sec=30, deadline_grace_sec=30)
    assert second.attempt == 2 and second.started_at >= first["finished_at"]
    behind = Completion(second, Outcome.success("ok"), second.started_at - timedelta(seconds=2), None)
    assert await WorkerStore(pool, "worker-2").complete([behind]) == {second.run_id}
    attempts = await pool.fetch("SELECT attempt, started_at, finished_at FROM run_attempt_history WHERE run_id = $1 "
                                "ORDER BY attempt", claimed.run_id)
    assert [a["attempt"] for a in attempts] == [1, 2]
    assert all(a["started_at"] <= a["finished_at"] for a in attempts)
    assert attempts[0]["finished_at"] <= attempts[1]["started_at"]
