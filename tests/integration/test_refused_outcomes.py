"""An outcome refused after a write whose commit did not last: the run is given up, not held by its claim.

A worker's write of outcomes can time out waiting for a synchronous standby, committed on the
primary and never replicated; written again, it is refused there (the run is no longer running). Once
the standby is promoted, the run is still running there under the worker's claim, whose lease the
heartbeat extends for the claim's other runs. The heartbeat gives it up (a lease of its own, expired),
so the reaper ends the attempt as a lost one, to be retried.

Here one database plays both: the run's lease token is changed while the outcome is written (the
write finds the run no longer running under its claim, as on the old primary), then restored (as on
the promoted standby, which never saw the write).
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import asyncpg

from chimes.enums import RunStatus
from chimes.store.working import ClaimedRun, Completion
from chimes.worker.tasks.common import Outcome
from chimes.worker.worker import Worker, WorkerConfig
from tests.integration.test_fencing import fire_due_one_offs

LEASES = """
SELECT run_id, expires_at <= now() AS expired FROM leases_in_force WHERE run_id = ANY($1::uuid[])
"""


async def test_a_run_whose_outcome_was_refused_is_given_up_while_its_claim_is_still_held(
        pool: asyncpg.Pool, database_url: str) -> None:
    store, leases = await fire_due_one_offs(pool, 2)
    worker = Worker(pool, database_url, WorkerConfig(), worker_id="worker")
    never = asyncio.Event()
    claimed = await worker.store.claim(2, 30, 30)
    assert len(claimed) == 2 and claimed[0].lease_token == claimed[1].lease_token  # one claim
    ended, still_running = claimed
    for run in claimed:  # as the claim loop does
        worker._leases.claims.setdefault(run.lease_token, set()).add(run.run_id)
    worker._running[still_running.run_id] = (still_running, asyncio.create_task(never.wait()))
    try:
        await _outcome_refused(pool, worker, ended)
        assert ended.run_id not in worker._leases.claims[ended.lease_token]  # this worker let it go

        await worker._heartbeat.beat()
        rows = {row["run_id"]: row["expired"] for row in await pool.fetch(LEASES, [r.run_id for r in claimed])}
        assert rows == {ended.run_id: True, still_running.run_id: False}, rows
        reaped = await store.expired_runs(list(leases), 100)
        assert [run.run_id for run in reaped] == [ended.run_id]
    finally:
        for _, task in worker._running.values():
            task.cancel()


async def _outcome_refused(pool: asyncpg.Pool, worker: Worker, run: ClaimedRun) -> None:
    """The outcome of ``run`` is written where the run no longer runs under its claim, and refused."""
    await pool.execute("UPDATE runs SET lease_token = $2 WHERE run_id = $1", run.run_id, uuid.uuid4())
    outcome = Outcome(RunStatus.SUCCEEDED, None, "ok")
    worker._completer.outcomes.append(Completion(run, outcome, datetime.now(UTC), None))
    await worker._completer.flush()
    assert worker.completed == 0
    await pool.execute("UPDATE runs SET lease_token = $2 WHERE run_id = $1", run.run_id, run.lease_token)
