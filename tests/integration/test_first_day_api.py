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
