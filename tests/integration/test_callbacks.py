"""Long and asynchronous tasks: the target answers 202 and reports for itself through callbacks."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import httpx

from tests.helpers import Homes, let_time_pass_for_runs, wait_for
from tests.integration.fleet import FAST_WORKER, Fleet
from tests.target import Target


def async_job(target: Target, **extra: object) -> dict:
    at = (datetime.now(UTC) + timedelta(seconds=0.3)).isoformat()
    return {"name": "async", "schedule": {"at": at},
            "task": {"type": "http", "url": target.url + "/async", "callback": True}} | extra


async def status_of(homes: Homes, job_id: str) -> str | None:
    return await homes.fetchval(job_id, "SELECT status FROM runs WHERE job_id = $1", uuid.UUID(job_id))


async def test_target_keeps_the_run_alive_and_completes_it(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    target.responders["/async"] = target.responders["/silent"] = lambda n: 202
    job_id = (await client.post("/jobs", json=async_job(target))).json()["jobId"]
    # A second run, whose target never heartbeats: the reaper must end that one in the same time.
    silent_task = {"type": "http", "url": target.url + "/silent", "callback": True}
    assert (await client.post("/jobs", json=async_job(target, task=silent_task))).status_code == 201
    [call] = await wait_for(lambda: target.calls_to("/async"), timeout=10, what="the target to be called")
    [silent] = await wait_for(lambda: target.calls_to("/silent"), timeout=10, what="the silent run to start")
    run_id, token = call.run_id, call.headers["X-Chimes-Lease-Token"]
    # The worker lets go of a run its target accepted: from then on no worker renews its lease.
    await wait_for(lambda: not {uuid.UUID(call.run_id), uuid.UUID(silent.run_id)} & fleet.running(),
                   timeout=10, what="the worker to hand both runs to their target")
    assert await status_of(homes, job_id) == "running"
    beat = await client.post(f"/runs/{run_id}/heartbeat", json={"leaseToken": token})
    assert beat.status_code == 200, beat.text
    assert datetime.fromisoformat(beat.json()["leaseExpiresAt"]) > datetime.now(UTC) + timedelta(seconds=20)
    # Outlast the worker's own lease (3 s here) on the database's clock, for both runs: the reaper
    # ends the silent one and must leave this one alone, as the target's heartbeat extended it.
    await let_time_pass_for_runs(homes, [uuid.UUID(run_id), uuid.UUID(silent.run_id)], FAST_WORKER.lease_sec + 1.5)
    reaped = await wait_for(lambda: homes.fetchval_anywhere("SELECT error FROM run_attempts WHERE run_id = $1",
                                                            uuid.UUID(silent.run_id)),
                            timeout=10, what="the reaper to end the run nobody heartbeats")
    assert "stopped heartbeating" in reaped
    assert await status_of(homes, job_id) == "running"
    done = await client.post(f"/runs/{run_id}/complete", json={"leaseToken": token, "status": "succeeded",
                                                               "output": "42 rows"})
    assert done.status_code == 200 and done.json()["status"] == "succeeded"
    assert done.json()["attempts"][-1]["output"] == "42 rows"
    stale = await client.post(f"/runs/{run_id}/complete", json={"leaseToken": token, "status": "failed"})
    assert stale.status_code == 409 and stale.json()["field"] == "leaseToken"
    assert (await client.post(f"/runs/{run_id}/heartbeat", json={"leaseToken": token})).status_code == 409


async def test_reported_failure_follows_the_retry_policy(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    target.responders["/async"] = lambda n: 202
    job = async_job(target, retryPolicy={"maxAttempts": 2, "initialBackoffSec": 0.2, "jitter": 0})
    job_id = (await client.post("/jobs", json=job)).json()["jobId"]
    [first] = await wait_for(lambda: target.calls_to("/async"), timeout=10, what="attempt 1")
    failed = await client.post(f"/runs/{first.run_id}/complete",
                               json={"leaseToken": first.headers["X-Chimes-Lease-Token"], "status": "failed",
                                     "error": "export crashed"})
    assert failed.status_code == 200 and failed.json()["status"] == "scheduled"
    calls = await wait_for(lambda: target.calls_to("/async")[1:], timeout=10, what="attempt 2")
    assert calls[0].attempt == 2 and calls[0].headers["X-Chimes-Lease-Token"] != first.headers["X-Chimes-Lease-Token"]
    await client.post(f"/runs/{first.run_id}/complete",
                      json={"leaseToken": calls[0].headers["X-Chimes-Lease-Token"], "status": "failed"})
    assert await status_of(homes, job_id) == "failed"


async def test_callbacks_refuse_other_teams_and_bad_tokens(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, tokens: dict[str, str]
) -> None:
    target.responders["/async"] = lambda n: 202
    await client.post("/jobs", json=async_job(target))
    [call] = await wait_for(lambda: target.calls_to("/async"), timeout=10, what="the target to be called")
    other = {"Authorization": f"Bearer {tokens['team-b']}"}
    body = {"leaseToken": call.headers["X-Chimes-Lease-Token"], "status": "succeeded"}
    assert (await client.post(f"/runs/{call.run_id}/complete", json=body, headers=other)).status_code == 409
    wrong = await client.post(f"/runs/{call.run_id}/complete", json=body | {"leaseToken": str(uuid.uuid4())})
    assert wrong.status_code == 409
    invalid = await client.post(f"/runs/{call.run_id}/complete", json=body | {"status": "maybe"})
    assert invalid.status_code == 422 and invalid.json()["field"] == "status"


async def test_without_callback_a_202_is_plain_success(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    target.responders["/accepted"] = lambda n: 202
    at = (datetime.now(UTC) + timedelta(seconds=0.3)).isoformat()
    task = {"type": "http", "url": target.url + "/accepted"}
    job_id = (await client.post("/jobs", json={"name": "plain", "schedule": {"at": at}, "task": task})).json()["jobId"]
    await wait_for(lambda: _is(homes, job_id, "succeeded"), timeout=10, what="the run to succeed")


async def _is(homes: Homes, job_id: str, status: str) -> bool:
    return await status_of(homes, job_id) == status
