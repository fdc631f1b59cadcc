"""What a new user meets on the first day, through the real API: manual runs that stay distinct,
a deleted job's history, conditional edits with ETag/If-Match, oversized bodies, and the overall
deadline of a run's retries."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import asyncpg
import httpx

from chimes.store.runs import RunStore
from tests.helpers import auth_as, wait_for
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


async def test_manual_runs_in_the_same_millisecond_stay_two(client: httpx.AsyncClient, pool: asyncpg.Pool) -> None:
    job = (await client.post("/jobs", json=http_job("http://127.0.0.1:9"))).json()
    store, now = RunStore(pool), datetime.now(UTC)
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
