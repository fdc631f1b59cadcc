"""What a new user meets on the first day, through the real API: manual runs that stay distinct,
a deleted job's history, conditional edits with ETag/If-Match, oversized bodies, and the overall
deadline of a run's retries."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
import uuid
from datetime import UTC, datetime

import httpx

from chimes.store.runs import RunStore
from tests.helpers import Homes, auth_as, wait_for
from tests.integration.fleet import Fleet
from tests.target import Target


def http_job(target_url: str, path: str = "/hook", **extra: object) -> dict:
    return {"name": path.strip("/") or "job", "schedule": {"cron": "0 2 * * *"},
            "task": {"type": "http", "url": target_url + path}} | extra


async def runs_of(client: httpx.AsyncClient, job_id: str, **params: object) -> list[dict]:
    answer = await client.get(f"/jobs/{job_id}/runs", params={"limit": 500, **params})
    assert answer.status_code == 200, answer.text
    return answer.json()["runs"]


# ------------------------------------------------------------------------------------ manual runs


async def test_concurrent_manual_runs_are_each_a_run_and_each_executed(
    fleet: Fleet, client: httpx.AsyncClient, target: Target
) -> None:
    job = (await client.post("/jobs", json=http_job(target.url, "/manual", concurrency="allow"))).json()
    answers = await asyncio.gather(*(client.post(f"/jobs/{job['jobId']}/runs") for _ in range(40)))
    assert [a.status_code for a in answers] == [202] * 40
    run_ids = {a.json()["runId"] for a in answers}
    assert len(run_ids) == 40  # each accepted call is its own run

    async def all_succeeded() -> bool:
        runs = await runs_of(client, job["jobId"])
        return len(runs) == 40 and all(r["status"] == "succeeded" for r in runs)

    await wait_for(all_succeeded, timeout=30, what="40 manual runs to succeed")
    assert {r["runId"] for r in await runs_of(client, job["jobId"])} == run_ids
    assert {c.run_id for c in target.calls_to("/manual")} == run_ids


async def test_manual_runs_in_the_same_millisecond_stay_two(client: httpx.AsyncClient, homes: Homes) -> None:
    job = (await client.post("/jobs", json=http_job("http://127.0.0.1:9"))).json()
    store, now = RunStore(await homes.for_job(uuid.UUID(job["jobId"]))), datetime.now(UTC)
    first = await store.start_now(uuid.UUID(job["jobId"]), "team-a", "manual", now)
    second = await store.start_now(uuid.UUID(job["jobId"]), "team-a", "manual", now)
    assert first != second
    assert len(await runs_of(client, job["jobId"])) == 2


# ------------------------------------------------------------------------------- deleted job history


async def test_deleted_job_history_stays_listable_by_its_owner(
    client: httpx.AsyncClient, tokens: dict[str, str]
) -> None:
    job_id = (await client.post("/jobs", json=http_job("http://127.0.0.1:9"))).json()["jobId"]
    run_ids = {(await client.post(f"/jobs/{job_id}/runs")).json()["runId"] for _ in range(3)}
    assert (await client.delete(f"/jobs/{job_id}")).status_code == 204

    listed = await client.get(f"/jobs/{job_id}/runs")
    assert listed.status_code == 200, listed.text
    assert listed.json()["jobDeleted"] is True
    assert {r["runId"] for r in listed.json()["runs"]} == run_ids
    assert len(await runs_of(client, job_id, status="scheduled")) == 3
    paged = await client.get(f"/jobs/{job_id}/runs", params={"limit": 2})
    assert len(paged.json()["runs"]) == 2 and paged.json()["nextCursor"]

    gone = await client.get(f"/jobs/{job_id}")
    assert gone.status_code == 404 and gone.json()["error"] == "job_deleted"
    assert f"/jobs/{job_id}/runs" in gone.json()["message"]

    # Another team sees nothing at all, exactly as for a job that never existed.
    other = auth_as(tokens["team-b"])
    assert (await client.get(f"/jobs/{job_id}/runs", headers=other)).status_code == 404
    foreign = await client.get(f"/jobs/{job_id}", headers=other)
    assert foreign.status_code == 404 and foreign.json()["error"] == "not_found"
    # An admin sees the history too.
    admin = await client.get(f"/jobs/{job_id}/runs", headers=auth_as(tokens["admin"]))
    assert admin.status_code == 200 and len(admin.json()["runs"]) == 3


async def test_a_live_job_history_says_it_is_not_deleted(client: httpx.AsyncClient) -> None:
    job_id = (await client.post("/jobs", json=http_job("http://127.0.0.1:9"))).json()["jobId"]
    listed = (await client.get(f"/jobs/{job_id}/runs")).json()
    assert listed == {"runs": [], "nextCursor": None, "jobDeleted": False}


# --------------------------------------------------------------------------------- ETag and If-Match


async def test_job_answers_carry_an_etag_that_if_match_checks(
    client: httpx.AsyncClient, tokens: dict[str, str]
) -> None:
    created = await client.post("/jobs", json=http_job("http://127.0.0.1:9"))
    assert created.headers["ETag"] == '"1"'
    job_id = created.json()["jobId"]
    read = await client.get(f"/jobs/{job_id}")
    assert read.headers["ETag"] == '"1"'

    # Two clients read version 1; the first change wins, the second is refused and changes nothing.
    first = await client.patch(f"/jobs/{job_id}", json={"name": "first"}, headers={"If-Match": '"1"'})
    assert first.status_code == 200, first.text
    assert first.headers["ETag"] == '"2"' and first.json()["version"] == 2
    stale = await client.patch(f"/jobs/{job_id}", json={"name": "second"}, headers={"If-Match": '"1"'})
    assert stale.status_code == 412
    assert stale.json()["error"] == "precondition_failed" and stale.json()["field"] == "If-Match"
    assert "version 2" in stale.json()["message"] and stale.headers["ETag"] == '"2"'
    now = await client.get(f"/jobs/{job_id}")
    assert now.json()["name"] == "first" and now.json()["version"] == 2

    # A weak tag never matches (strong comparison); a list matches when one of its tags does.
    weak = await client.patch(f"/jobs/{job_id}", json={"paused": True}, headers={"If-Match": 'W/"2"'})
    assert weak.status_code == 412
    listed = await client.patch(f"/jobs/{job_id}", json={"paused": True}, headers={"If-Match": '"7", "2"'})
    assert listed.status_code == 200 and listed.headers["ETag"] == '"3"'
    anything = await client.patch(f"/jobs/{job_id}", json={"paused": False}, headers={"If-Match": "*"})
    assert anything.status_code == 200 and anything.headers["ETag"] == '"4"'

    # Another team gets 404 whatever its If-Match says, as for a job that does not exist.
    other = auth_as(tokens["team-b"]) | {"If-Match": '"4"'}
    assert (await client.patch(f"/jobs/{job_id}", json={"name": "x"}, headers=other)).status_code == 404
    assert (await client.delete(f"/jobs/{job_id}", headers=other)).status_code == 404

    # DELETE: refused while stale, done when current.
    assert (await client.delete(f"/jobs/{job_id}", headers={"If-Match": '"3"'})).status_code == 412
    assert (await client.get(f"/jobs/{job_id}")).status_code == 200
    assert (await client.delete(f"/jobs/{job_id}", headers={"If-Match": '"4"'})).status_code == 204
    assert (await client.delete(f"/jobs/{job_id}", headers={"If-Match": "*"})).status_code == 404


async def test_idempotent_create_answers_the_etag_of_the_job_it_returns(client: httpx.AsyncClient) -> None:
    key = {"Idempotency-Key": "etag-1"}
    job_id = (await client.post("/jobs", json=http_job("http://127.0.0.1:9"), headers=key)).json()["jobId"]
    await client.patch(f"/jobs/{job_id}", json={"paused": True})
    again = await client.post("/jobs", json=http_job("http://127.0.0.1:9"), headers=key)
    assert again.status_code == 200 and again.headers["ETag"] == '"2"'



# ---------------------------------------------------------------------------------- oversized bodies

# 10 MB: on loopback the kernel's socket buffers swallow a few MB, which hides the broken pipe that a
# 3 MB body already meets over a network.
OVERSIZED = b'{"name": "' + b"x" * (10 * 1024 * 1024) + b'"}'


def _post_with_urllib(url: str, token: str) -> tuple[int, dict]:
    request = urllib.request.Request(url + "/jobs", data=OVERSIZED, method="POST",
                                     headers=auth_as(token) | {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


def _post_with_httpx(url: str, token: str, chunked: bool, data: bytes = OVERSIZED) -> tuple[int, dict]:
    body = iter([data[i:i + 65536] for i in range(0, len(data), 65536)]) if chunked else data
    with httpx.Client(timeout=30) as http:
        answer = http.post(url + "/jobs", content=body, headers=auth_as(token) | {"Content-Type": "application/json"})
        return answer.status_code, answer.json()


async def test_oversized_body_answers_413_that_ordinary_clients_read(
    api_url: str, tokens: dict[str, str], client: httpx.AsyncClient
) -> None:
    token = tokens["team-a"]
    for send in (lambda: _post_with_urllib(api_url, token), lambda: _post_with_httpx(api_url, token, False),
                 lambda: _post_with_httpx(api_url, token, True),
                 lambda: _post_with_httpx(api_url, token, True, b"x" * (1024 * 1024 + 1))):
        status, body = await asyncio.to_thread(send)
        assert status == 413 and body["error"] == "payload_too_large", body
    # The server is fine afterwards, and nothing was created.
    assert (await client.get("/jobs")).json()["jobs"] == []


# ----------------------------------------------------------------------------------- write limits


async def test_a_script_creating_1000_jobs_with_8_clients_is_not_throttled(
    api_url: str, tokens: dict[str, str], client: httpx.AsyncClient
) -> None:
    statuses: list[int] = []

    async def create(worker: int) -> None:
        async with httpx.AsyncClient(base_url=api_url, headers=auth_as(tokens["team-a"]), timeout=60) as http:
            for n in range(125):
                answer = await http.post("/jobs", json=http_job("http://127.0.0.1:9", f"/w{worker}-{n}"))
                statuses.append(answer.status_code)

    await asyncio.gather(*(create(w) for w in range(8)))
    assert statuses == [201] * 1000
    listed = await client.get("/jobs", params={"limit": 500})
    assert len(listed.json()["jobs"]) == 500 and listed.json()["nextCursor"]


# ------------------------------------------------------------------------- an overall retry deadline


async def test_retries_stop_at_max_duration_and_the_run_fails_saying_why(
    fleet: Fleet, client: httpx.AsyncClient, target: Target
) -> None:
    target.responders["/down"] = lambda n: 503
    policy = {"maxAttempts": 50, "initialBackoffSec": 0.5, "multiplier": 1, "maxBackoffSec": 0.5, "jitter": 0,
              "maxDurationSec": 2}
    created = await client.post("/jobs", json=http_job(target.url, "/down", retryPolicy=policy))
    assert created.status_code == 201, created.text
    job_id = created.json()["jobId"]
    assert (await client.get(f"/jobs/{job_id}")).json()["retryPolicy"]["maxDurationSec"] == 2
    run_id = (await client.post(f"/jobs/{job_id}/runs")).json()["runId"]

    async def ended() -> dict | None:
        run = (await client.get(f"/runs/{run_id}")).json()
        return run if run["status"] in ("succeeded", "failed") else None

    run = await wait_for(ended, timeout=20, what="the run to fail")
    assert run["status"] == "failed"
    assert "retryPolicy.maxDurationSec" in run["error"] and "HTTP 503" in run["error"]
    assert 2 <= len(run["attempts"]) < 10
    deadline = datetime.fromisoformat(run["scheduledAt"]).timestamp() + 2
    # Each attempt was scheduled within the 2 s; a worker picks one up within its poll interval.
    assert all(datetime.fromisoformat(a["startedAt"]).timestamp() < deadline + 1.0 for a in run["attempts"])
    assert len(target.calls_to("/down")) == len(run["attempts"])


async def test_max_duration_is_optional_and_positive(client: httpx.AsyncClient) -> None:
    answer = await client.post("/jobs", json=http_job("http://127.0.0.1:9", retryPolicy={"maxDurationSec": 0}))
    assert answer.status_code == 422 and answer.json()["field"] == "retryPolicy.maxDurationSec"
    assert "greater than 0" in answer.json()["message"]
    job_id = (await client.post("/jobs", json=http_job("http://127.0.0.1:9"))).json()["jobId"]
    assert "maxDurationSec" not in (await client.get(f"/jobs/{job_id}")).json()["retryPolicy"]
    patched = await client.patch(f"/jobs/{job_id}", json={"retryPolicy": {"maxDurationSec": 3600}})
    assert patched.status_code == 200 and patched.json()["retryPolicy"]["maxDurationSec"] == 3600
