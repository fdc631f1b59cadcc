"""The job lifecycle through the real HTTP API on a real PostgreSQL."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, time, timedelta
from zoneinfo import ZoneInfo

import asyncpg
import httpx

from chimes import __version__
from tests.helpers import Homes, auth_as

HTTP_TASK = {"type": "http", "method": "POST", "url": "http://127.0.0.1:9/hook", "headers": {"X-Team": "a"},
             "body": {"full": True}}

BERLIN = ZoneInfo("Europe/Berlin")


def cron_job(**overrides: object) -> dict:
    job = {"name": "nightly", "schedule": {"cron": "0 2 * * *", "timezone": "Europe/Berlin"}, "task": HTTP_TASK}
    job.update(overrides)
    return job


async def trigger_rows(homes: Homes, job_id: str) -> list[asyncpg.Record]:
    home = await homes.for_job(job_id)
    return await home.fetch("SELECT * FROM triggers WHERE job_id = $1 AND kind = 0", uuid.UUID(job_id))


async def test_create_get_returns_definition_and_next_run(client: httpx.AsyncClient, homes: Homes) -> None:
    created = await client.post("/jobs", json=cron_job())
    assert created.status_code == 201, created.text
    job_id = created.json()["jobId"]
    next_run = datetime.fromisoformat(created.json()["nextRunAt"])
    now = datetime.now(BERLIN)
    # The next 02:00 in Berlin. Across a DST change, fold=0 picks what cron.py does: the first 02:00 of a
    # fall-back night, 03:00 CEST (the end of the gap) on the spring-forward one.
    expected = datetime.combine(now.date() + timedelta(days=0 if now.hour < 2 else 1), time(2), BERLIN)
    assert next_run == expected and created.json()["nextRunAt"].endswith("Z")
    # 02:00 in Berlin is 00:00 or 01:00 UTC depending on the season.
    assert next_run.minute == 0 and next_run.hour in (0, 1)

    got = (await client.get(f"/jobs/{job_id}")).json()
    assert got["jobId"] == job_id
    assert got["owner"] == "team-a"
    assert got["schedule"] == {"cron": "0 2 * * *", "timezone": "Europe/Berlin"}
    assert got["task"]["url"] == HTTP_TASK["url"]
    assert got["retryPolicy"]["maxAttempts"] == 3
    assert got["timeoutSec"] == 3600 and got["concurrency"] == "skip" and got["priority"] == "normal"
    assert got["version"] == 1 and got["paused"] is False
    assert datetime.fromisoformat(got["nextRunAt"]) == next_run
    assert got["lastRun"] is None
    triggers = await trigger_rows(homes, job_id)
    assert [t["fire_at"] for t in triggers] == [next_run]


async def test_one_off_job_fires_at_its_time(client: httpx.AsyncClient, homes: Homes) -> None:
    at = (datetime.now(UTC) + timedelta(hours=1)).replace(microsecond=123456)
    created = await client.post("/jobs", json={"name": "once", "schedule": {"at": at.isoformat()}, "task": HTTP_TASK})
    assert created.status_code == 201, created.text
    assert datetime.fromisoformat(created.json()["nextRunAt"]) == at.replace(microsecond=123000)


async def test_list_pages_with_cursor(client: httpx.AsyncClient) -> None:
    ids = [(await client.post("/jobs", json=cron_job(name=f"job-{i}"))).json()["jobId"] for i in range(5)]
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        params = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        page = (await client.get("/jobs", params=params)).json()
        seen += [j["jobId"] for j in page["jobs"]]
        pages += 1
        cursor = page["nextCursor"]
        if cursor is None:
            break
    assert seen == ids  # creation order, no duplicates, nothing missing
    assert pages == 3


async def test_update_bumps_version_and_rewrites_trigger(client: httpx.AsyncClient, homes: Homes) -> None:
    job_id = (await client.post("/jobs", json=cron_job())).json()["jobId"]
    changed = await client.patch(f"/jobs/{job_id}", json={"schedule": {"cron": "*/5 * * * *"}, "name": "renamed"})
    assert changed.status_code == 200, changed.text
    body = changed.json()
    assert body["version"] == 2 and body["name"] == "renamed"
    assert body["schedule"] == {"cron": "*/5 * * * *", "timezone": "UTC"}
    triggers = await trigger_rows(homes, job_id)
    assert len(triggers) == 1
    assert triggers[0]["job_version"] == 2
    assert triggers[0]["fire_at"].minute % 5 == 0
    assert triggers[0]["fire_at"] - datetime.now(UTC) <= timedelta(minutes=5)


async def test_pause_removes_trigger_and_resume_restores_it(client: httpx.AsyncClient, homes: Homes) -> None:
    job_id = (await client.post("/jobs", json=cron_job())).json()["jobId"]
    paused = (await client.patch(f"/jobs/{job_id}", json={"paused": True})).json()
    assert paused["paused"] is True and paused["version"] == 2 and paused["nextRunAt"] is None
    assert await trigger_rows(homes, job_id) == []
    resumed = (await client.patch(f"/jobs/{job_id}", json={"paused": False})).json()
    assert resumed["paused"] is False and resumed["version"] == 3 and resumed["nextRunAt"] is not None
    triggers = await trigger_rows(homes, job_id)
    assert len(triggers) == 1 and triggers[0]["job_version"] == 3


async def test_delete_removes_job_and_trigger(client: httpx.AsyncClient, homes: Homes) -> None:
    job_id = (await client.post("/jobs", json=cron_job())).json()["jobId"]
    assert (await client.delete(f"/jobs/{job_id}")).status_code == 204
    assert (await client.get(f"/jobs/{job_id}")).status_code == 404
    assert (await client.delete(f"/jobs/{job_id}")).status_code == 404
    assert await homes.total("SELECT count(*) FROM triggers") == 0
    assert await homes.total("SELECT count(*) FROM jobs") == 0


async def test_idempotency_key_makes_create_safe_to_retry(client: httpx.AsyncClient, homes: Homes) -> None:
    headers = {"Idempotency-Key": "create-nightly-1"}
    first = await client.post("/jobs", json=cron_job(), headers=headers)
    second = await client.post("/jobs", json=cron_job(), headers=headers)
    assert first.status_code == 201 and second.status_code == 200
    assert first.json()["jobId"] == second.json()["jobId"]
    assert await homes.total("SELECT count(*) FROM jobs") == 1
    different = await client.post("/jobs", json=cron_job(name="other"), headers=headers)
    assert different.status_code == 409
    assert different.json()["field"] == "Idempotency-Key"
    assert await homes.total("SELECT count(*) FROM jobs") == 1


async def test_failure_between_job_and_trigger_writes_leaves_neither(
    client: httpx.AsyncClient, homes: Homes
) -> None:
    # A real database failure on the trigger insert, after the job row was written in the same transaction.
    for home in await homes.homes():
        await home.execute("""
        CREATE FUNCTION refuse_trigger() RETURNS trigger LANGUAGE plpgsql AS
        $$ BEGIN RAISE EXCEPTION 'trigger index unavailable'; END $$;
        CREATE TRIGGER refuse BEFORE INSERT ON triggers FOR EACH ROW EXECUTE FUNCTION refuse_trigger();
    """)
    response = await client.post("/jobs", json=cron_job())
    assert response.status_code == 500
    assert await homes.total("SELECT count(*) FROM jobs") == 0
    assert await homes.total("SELECT count(*) FROM triggers") == 0


async def test_ownership_is_enforced(client: httpx.AsyncClient, tokens: dict[str, str], homes: Homes) -> None:
    job_id = (await client.post("/jobs", json=cron_job())).json()["jobId"]
    other = auth_as(tokens["team-b"])
    assert (await client.get(f"/jobs/{job_id}", headers=other)).status_code == 404
    assert (await client.patch(f"/jobs/{job_id}", json={"paused": True}, headers=other)).status_code == 404
    assert (await client.delete(f"/jobs/{job_id}", headers=other)).status_code == 404
    assert (await client.get("/jobs", headers=other)).json()["jobs"] == []
    assert (await client.post(f"/jobs/{job_id}/runs", headers=other)).status_code == 404
    assert (await client.get(f"/jobs/{job_id}/runs", headers=other)).status_code == 404
    # Nothing changed for the owner.
    job = (await client.get(f"/jobs/{job_id}")).json()
    assert job["version"] == 1 and job["paused"] is False
    # An admin sees every team's jobs.
    admin = auth_as(tokens["admin"])
    assert (await client.get(f"/jobs/{job_id}", headers=admin)).status_code == 200
    assert [j["jobId"] for j in (await client.get("/jobs", headers=admin)).json()["jobs"]] == [job_id]


async def test_missing_or_bad_token_is_401(api_url: str, homes: Homes) -> None:
    async with httpx.AsyncClient(base_url=api_url) as anonymous:
        health = await anonymous.get("/healthz")
        assert (health.status_code, health.json()["version"]) == (200, __version__)  # the release it runs
        for headers in ({}, {"Authorization": "Bearer chm_nope"}, {"Authorization": "Basic abc"}):
            response = await anonymous.get("/jobs", headers=headers)
            assert response.status_code == 401, headers
            assert response.json()["error"] == "unauthorized"
            assert (await anonymous.post("/jobs", json=cron_job(), headers=headers)).status_code == 401
    assert await homes.total("SELECT count(*) FROM jobs") == 0
