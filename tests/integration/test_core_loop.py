"""Runs actually happen: fired on time, executed, retried, recorded (in-process fleet, real PostgreSQL)."""

from __future__ import annotations

import itertools
import uuid
from datetime import UTC, datetime, timedelta

import httpx

from chimes.ids import run_id_for
from tests.helpers import Homes, wait_for
from tests.integration.fleet import Fleet
from tests.target import Target


def http_job(target: Target, path: str, schedule: dict, **extra: object) -> dict:
    return {"name": path.strip("/"), "schedule": schedule, "task": {"type": "http", "url": target.url + path}} | extra


def soon(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


async def run_of(client: httpx.AsyncClient, run_id: str) -> dict:
    return (await client.get(f"/runs/{run_id}")).json()


async def runs_of(client: httpx.AsyncClient, job_id: str, **params: object) -> list[dict]:
    return (await client.get(f"/jobs/{job_id}/runs", params=params)).json()["runs"]


async def test_one_off_job_calls_target_with_headers_and_succeeds(
    fleet: Fleet, client: httpx.AsyncClient, target: Target
) -> None:
    job = (await client.post("/jobs", json=http_job(target, "/once", {"at": soon(1)}))).json()
    calls = await wait_for(lambda: target.calls_to("/once"), timeout=10, what="the target to be called")
    call = calls[0]
    [run] = await wait_for(lambda: _finished(client, job["jobId"]), timeout=10, what="the run to finish")
    assert run["status"] == "succeeded" and run["attempt"] == 1 and run["trigger"] == "schedule"
    assert call.headers["Idempotency-Key"] == run["runId"] == call.run_id
    assert call.headers["X-Chimes-Job-Id"] == job["jobId"]
    assert call.headers["X-Chimes-Attempt"] == "1"
    assert datetime.fromisoformat(call.headers["X-Chimes-Scheduled-At"]) == datetime.fromisoformat(job["nextRunAt"])
    # Started on time: within 2 s of the scheduled time.
    assert call.received_at - datetime.fromisoformat(job["nextRunAt"]).timestamp() < 2.0
    detail = await run_of(client, run["runId"])
    assert [a["status"] for a in detail["attempts"]] == ["succeeded"]
    assert detail["attempts"][0]["output"] == "answer 200"
    # A one-off job leaves no trigger behind.
    assert (await client.get(f"/jobs/{job['jobId']}")).json()["nextRunAt"] is None


async def _finished(client: httpx.AsyncClient, job_id: str, count: int = 1) -> list[dict] | None:
    runs = await runs_of(client, job_id)
    done = [r for r in runs if r["status"] in ("succeeded", "failed", "cancelled")]
    return done if len(done) >= count else None


async def test_six_field_cron_fires_every_two_seconds_without_drift(
    fleet: Fleet, client: httpx.AsyncClient, target: Target
) -> None:
    job = (await client.post("/jobs", json=http_job(target, "/tick", {"cron": "*/2 * * * * *"}))).json()
    runs = await wait_for(lambda: _finished(client, job["jobId"], 3), timeout=15, what="three runs")
    assert all(r["status"] == "succeeded" for r in runs)
    times = [datetime.fromisoformat(r["scheduledAt"]) for r in runs]
    assert times == sorted(times, reverse=True)  # newest first
    assert all(t.second % 2 == 0 and t.microsecond == 0 for t in times)
    assert all(a - b == timedelta(seconds=2) for a, b in itertools.pairwise(times))
    # Each run reached the target once with its own idempotency key.
    keys = [c.headers["Idempotency-Key"] for c in target.calls_to("/tick")]
    assert len(keys) == len(set(keys))


async def test_failing_target_is_retried_with_growing_gaps(
    fleet: Fleet, client: httpx.AsyncClient, target: Target
) -> None:
    target.responders["/flaky"] = lambda n: 503 if n <= 2 else 200
    policy = {"maxAttempts": 5, "initialBackoffSec": 0.4, "multiplier": 3, "maxBackoffSec": 60, "jitter": 0}
    job = (await client.post("/jobs", json=http_job(target, "/flaky", {"at": soon(0.5)}, retryPolicy=policy))).json()
    [run] = await wait_for(lambda: _finished(client, job["jobId"]), timeout=20, what="the run to succeed")
    assert run["status"] == "succeeded" and run["attempt"] == 3
    calls = target.calls_to("/flaky")
    assert [c.attempt for c in calls] == [1, 2, 3]
    assert len({c.headers["Idempotency-Key"] for c in calls}) == 1  # the same key on every attempt
    gaps = [b.received_at - a.received_at for a, b in itertools.pairwise(calls)]
    assert gaps[0] >= 0.4 and gaps[1] >= 1.2 and gaps[1] > gaps[0]
    detail = await run_of(client, run["runId"])
    assert [(a["attempt"], a["status"], a["error"]) for a in detail["attempts"]] == [
        (1, "failed", "HTTP 503"), (2, "failed", "HTTP 503"), (3, "succeeded", None)]


async def test_exhausted_attempts_fail_the_run(fleet: Fleet, client: httpx.AsyncClient, target: Target) -> None:
    target.responders["/down"] = lambda n: 500
    policy = {"maxAttempts": 2, "initialBackoffSec": 0.2, "jitter": 0}
    job = (await client.post("/jobs", json=http_job(target, "/down", {"at": soon(0.5)}, retryPolicy=policy))).json()
    [run] = await wait_for(lambda: _finished(client, job["jobId"]), timeout=15, what="the run to fail")
    assert run["status"] == "failed" and run["error"] == "HTTP 500" and run["attempt"] == 2
    assert len(target.calls_to("/down")) == 2
    assert (await runs_of(client, job["jobId"], status="failed"))[0]["runId"] == run["runId"]
    assert await runs_of(client, job["jobId"], status="succeeded") == []


async def test_manual_run_rerun_and_cancel(fleet: Fleet, client: httpx.AsyncClient, target: Target) -> None:
    job = (await client.post("/jobs", json=http_job(target, "/manual", {"cron": "0 0 1 1 *"}))).json()
    first = await client.post(f"/jobs/{job['jobId']}/runs")
    assert first.status_code == 202
    run_id = first.json()["runId"]
    await wait_for(lambda: _status_is(client, run_id, "succeeded"), timeout=10, what="manual run")
    assert (await run_of(client, run_id))["trigger"] == "manual"
    again = await client.post(f"/runs/{run_id}/rerun")
    assert again.status_code == 202 and again.json()["runId"] != run_id
    await wait_for(lambda: _status_is(client, again.json()["runId"], "succeeded"), timeout=10, what="re-run")
    assert (await run_of(client, again.json()["runId"]))["trigger"] == "rerun"
    assert len(target.calls_to("/manual")) == 2
    finished = await client.post(f"/runs/{run_id}/cancel")
    assert finished.status_code == 409 and "succeeded" in finished.json()["message"]


async def test_cancel_stops_a_waiting_retry(fleet: Fleet, client: httpx.AsyncClient, target: Target,
                                            homes: Homes) -> None:
    target.responders["/slow-retry"] = lambda n: 503
    policy = {"maxAttempts": 3, "initialBackoffSec": 30, "jitter": 0}
    job = (await client.post("/jobs", json=http_job(target, "/slow-retry", {"at": soon(0.3)},
                                                    retryPolicy=policy))).json()
    await wait_for(lambda: target.calls_to("/slow-retry"), timeout=10, what="first attempt")
    [run] = await wait_for(lambda: _with_status(client, job["jobId"], "scheduled"), timeout=10,
                           what="the run to wait for its retry")
    cancelled = await client.post(f"/runs/{run['runId']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert await homes.total("SELECT count(*) FROM triggers WHERE kind = 1") == 0
    assert await homes.total("SELECT count(*) FROM run_queue") == 0


async def _status_is(client: httpx.AsyncClient, run_id: str, status: str) -> bool:
    return (await run_of(client, run_id)).get("status") == status


async def _with_status(client: httpx.AsyncClient, job_id: str, status: str) -> list[dict] | None:
    return [r for r in await runs_of(client, job_id) if r["status"] == status] or None


async def test_runs_are_listed_with_cursor(fleet: Fleet, client: httpx.AsyncClient, target: Target) -> None:
    job = (await client.post("/jobs", json=http_job(target, "/many", {"cron": "0 0 1 1 *"}))).json()
    ids = [(await client.post(f"/jobs/{job['jobId']}/runs")).json()["runId"] for _ in range(5)]
    seen, cursor = [], None
    while True:
        page = (await client.get(f"/jobs/{job['jobId']}/runs",
                                 params={"limit": 2} | ({"cursor": cursor} if cursor else {}))).json()
        seen += [r["runId"] for r in page["runs"]]
        cursor = page["nextCursor"]
        if cursor is None:
            break
    assert seen == list(reversed(ids))


async def test_unknown_run_is_404(client: httpx.AsyncClient) -> None:
    far_future = uuid.UUID("ffffffff-ffff-7fff-bfff-ffffffffffff")  # a v7 id whose time is past year 9999
    for run_id in (uuid.uuid4(), far_future, run_id_for(uuid.uuid4(), datetime(2026, 1, 1, tzinfo=UTC))):
        assert (await client.get(f"/runs/{run_id}")).status_code == 404
        assert (await client.post(f"/runs/{run_id}/cancel")).status_code == 404
        assert (await client.post(f"/runs/{run_id}/rerun")).status_code == 404


async def test_edits_and_pause_stop_the_old_definition_at_once(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    job = (await client.post("/jobs", json=http_job(target, "/v1", {"cron": "* * * * * *"}))).json()
    pool = await homes.for_job(job["jobId"])  # its runs' database
    await wait_for(lambda: _finished(client, job["jobId"], 2), timeout=15, what="runs of version 1")
    patched = await client.patch(f"/jobs/{job['jobId']}", json={"task": {"type": "http", "url": target.url + "/v2"}})
    assert patched.status_code == 200
    edited_at = datetime.now(UTC)
    await wait_for(lambda: target.calls_to("/v2"), timeout=10, what="runs of version 2")
    stale = await pool.fetchval("SELECT count(*) FROM runs WHERE job_version = 1 AND fired_at > $1", edited_at)
    assert stale == 0
    assert await pool.fetchval("SELECT count(*) FROM runs WHERE job_version = 2") >= 1

    paused = await client.patch(f"/jobs/{job['jobId']}", json={"paused": True})
    assert paused.status_code == 200
    paused_at = datetime.fromisoformat(paused.json()["pausedAt"])
    # The node still holds the paused job's next slots in its timer wheel, due on its own clock, with
    # nothing stored to move. A job on the same schedule shows when the node has fired two more slots
    # since the pause (a condition, not a guess at how long that takes under load); by then the
    # paused job's slots came due as well and must have fired nothing. (With shards, the job is in the
    # paused job's home, fired by the same node.)
    ticking = (await client.post("/jobs", json=http_job(target, "/tick", {"cron": "* * * * * *"}),
                                 headers={"Idempotency-Key": homes.key_beside("team-a", job["jobId"])})).json()
    await wait_for(lambda: pool.fetchval("SELECT count(*) FROM runs WHERE job_id = $1 AND scheduled_at >= $2",
                                         uuid.UUID(ticking["jobId"]), paused_at + timedelta(seconds=2)),
                   timeout=15, what="the node to fire two slots after the pause")
    # A slot due before the pause that had not fired yet fires after it (late, once); none after it.
    assert await pool.fetchval("SELECT count(*) FROM runs WHERE job_id = $1 AND scheduled_at > $2",
                               uuid.UUID(job["jobId"]), paused_at) == 0
