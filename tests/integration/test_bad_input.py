"""Every kind of bad input gets a clear error naming the field, and writes nothing."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import Homes
from tests.integration.test_jobs_api import HTTP_TASK, cron_job


def with_schedule(schedule: object) -> dict:
    return cron_job(schedule=schedule)


BAD_JOBS = [
    ("unknown time zone", with_schedule({"cron": "0 2 * * *", "timezone": "Mars/Base"}), "schedule.timezone",
     "unknown time zone"),
    ("path as time zone", with_schedule({"cron": "0 2 * * *", "timezone": "../../etc/passwd"}), "schedule.timezone",
     "unknown time zone"),
    ("invalid cron", with_schedule({"cron": "61 * * * *"}), "schedule.cron", "invalid cron expression"),
    ("seven fields", with_schedule({"cron": "* * * * * * *"}), "schedule.cron", "fields"),
    ("never fires", with_schedule({"cron": "0 0 30 2 *"}), "schedule.cron", "never fires"),
    # 02:30 on the second Sunday of March is always inside New York's spring-forward gap.
    ("never fires in its zone", with_schedule({"cron": "30 2 * 3 0#2", "timezone": "America/New_York",
                                                "dstGap": "skip"}), "schedule.cron", "never fires"),
    ("at without offset", with_schedule({"at": "2030-01-01T09:00:00"}), "schedule.at", "offset"),
    # Times no run can have: PostgreSQL keeps year 1 as -infinity, run ids count milliseconds from 1970,
    # and Python's datetime ends in year 9999. Accepted, the first one stopped every scheduler node.
    ("at in year 1", with_schedule({"at": "0001-01-01T00:00:00Z"}), "schedule.at", "outside the times"),
    ("at in year 1 east of UTC", with_schedule({"at": "0001-01-01T00:00:00+14:00"}), "schedule.at",
     "outside the times"),
    ("at before 1970", with_schedule({"at": "1969-12-31T23:59:59Z"}), "schedule.at", "outside the times"),
    ("at in year 9999", with_schedule({"at": "9999-06-01T00:00:00Z"}), "schedule.at", "outside the times"),
    ("both cron and at", with_schedule({"cron": "* * * * *", "at": "2030-01-01T09:00:00Z"}), "schedule",
     "exactly one"),
    ("unknown task type", cron_job(task={"type": "carrier-pigeon"}), "task", "type"),
    ("http task without url", cron_job(task={"type": "http"}), "task.url", "required"),
    ("non-http url", cron_job(task={**HTTP_TASK, "url": "file:///etc/passwd"}), "task.url", "pattern"),
    ("header injection", cron_job(task={**HTTP_TASK, "headers": {"X-A": "v\r\nX-Evil: 1"}}), "task.headers",
     "line break"),
    # Chimes' own headers: never sent from a task (the worker sends its own), so refused, in any case.
    ("a header of Chimes' own", cron_job(task={**HTTP_TASK, "headers": {"X-Chimes-Run-Id": "forged"}}),
     "task.headers", "X-Chimes-* headers are Chimes' own"),
    ("a header of Chimes' own in lower case", cron_job(task={**HTTP_TASK, "headers": {"x-chimes-signature": "t=1"}}),
     "task.headers", "X-Chimes-* headers are Chimes' own"),
    ("a header of Chimes' own, invented", cron_job(task={**HTTP_TASK, "headers": {"X-CHIMES-Tenant": "team-b"}}),
     "task.headers", "X-Chimes-* headers are Chimes' own"),
    ("a secret header of Chimes' own", cron_job(task={**HTTP_TASK, "secretHeaders": {"X-Chimes-Lease-Token": "x"}}),
     "task.secretHeaders", "X-Chimes-* headers are Chimes' own"),
    ("negative timeout", cron_job(timeoutSec=-5), "timeoutSec", "greater than"),
    ("zero attempts", cron_job(retryPolicy={"maxAttempts": 0}), "retryPolicy.maxAttempts", "greater than"),
    ("backoff upside down", cron_job(retryPolicy={"initialBackoffSec": 10, "maxBackoffSec": 1}), "retryPolicy",
     "maxBackoffSec"),
    ("unknown concurrency", cron_job(concurrency="sometimes"), "concurrency", "skip"),
    ("unknown priority", cron_job(priority="urgent"), "priority", "high"),
    ("unknown field", cron_job(schedul={"cron": "* * * * *"}), "schedul", "unknown field"),
    ("missing name", {"schedule": {"cron": "* * * * *"}, "task": HTTP_TASK}, "name", "required"),
    ("empty command", cron_job(task={"type": "command", "argv": []}), "task.argv", "at least 1"),
    ("multi-line container env", cron_job(task={"type": "container", "image": "alpine:3", "env": {"PEM": "a\nb"}}),
     "task.env", "line break"),
    ("multi-line container secret", cron_job(task={"type": "container", "image": "alpine:3",
                                                   "secretEnv": {"PEM": "a\r\nb"}}), "task.secretEnv", "line break"),
]


@pytest.mark.parametrize(("case", "body", "field", "words"), BAD_JOBS, ids=[c[0] for c in BAD_JOBS])
async def test_bad_job_is_refused_with_field_and_nothing_written(
    client: httpx.AsyncClient, homes: Homes, case: str, body: dict, field: str, words: str
) -> None:
    response = await client.post("/jobs", json=body)
    assert response.status_code == 422, response.text
    error = response.json()
    assert error["error"] == "invalid_request"
    assert error["field"] == field, error
    assert words.lower() in error["message"].lower(), error
    assert error["message"].startswith(f"{field}: ")
    assert await homes.total("SELECT count(*) FROM jobs") == 0
    assert await homes.total("SELECT count(*) FROM triggers") == 0


async def test_malformed_json_is_400(client: httpx.AsyncClient, homes: Homes) -> None:
    response = await client.post("/jobs", content=b'{"name": ', headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["message"]
    assert await homes.total("SELECT count(*) FROM jobs") == 0


async def test_body_over_limit_is_413(client: httpx.AsyncClient, homes: Homes) -> None:
    huge = cron_job(task={**HTTP_TASK, "body": {"blob": "x" * (2 * 1024 * 1024)}})
    response = await client.post("/jobs", json=huge)
    assert response.status_code == 413
    assert response.json()["field"] == "body"
    assert "limit" in response.json()["message"]
    assert await homes.total("SELECT count(*) FROM jobs") == 0


async def test_streamed_body_over_limit_is_413(client: httpx.AsyncClient, homes: Homes) -> None:
    async def chunks():  # no Content-Length: the limit must hold while streaming too
        for _ in range(40):
            yield b"x" * 65536

    response = await client.post("/jobs", content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert await homes.total("SELECT count(*) FROM jobs") == 0


async def test_bad_patch_changes_nothing(client: httpx.AsyncClient, homes: Homes) -> None:
    job_id = (await client.post("/jobs", json=cron_job())).json()["jobId"]
    pool = await homes.for_job(job_id)  # the job's database
    before = await pool.fetchrow("SELECT * FROM jobs")
    triggers_before = await pool.fetch("SELECT * FROM triggers")
    response = await client.patch(f"/jobs/{job_id}", json={"schedule": {"cron": "0 2 * * *", "timezone": "Nowhere/X"}})
    assert response.status_code == 422
    assert response.json()["field"] == "schedule.timezone"
    assert await pool.fetchrow("SELECT * FROM jobs") == before
    assert await pool.fetch("SELECT * FROM triggers") == triggers_before


async def test_bad_query_parameters(client: httpx.AsyncClient) -> None:
    response = await client.get("/jobs", params={"limit": 0})
    assert response.status_code == 422 and response.json()["field"] == "limit"
    response = await client.get("/jobs", params={"cursor": "!!!"})
    assert response.status_code == 400 and response.json()["field"] == "cursor"
    assert (await client.get("/jobs/not-a-uuid")).status_code == 404


async def test_a_patch_that_sets_a_header_of_chimes_own_is_refused_and_changes_nothing(
    client: httpx.AsyncClient, homes: Homes
) -> None:
    job_id = (await client.post("/jobs", json=cron_job())).json()["jobId"]
    pool = await homes.for_job(job_id)
    before = await pool.fetchrow("SELECT * FROM jobs")
    response = await client.patch(f"/jobs/{job_id}", json={"task": {**HTTP_TASK, "headers": {"X-Chimes-Job-Id": "x"}}})
    assert response.status_code == 422, response.text
    assert response.json()["field"] == "task.headers"
    assert await pool.fetchrow("SELECT * FROM jobs") == before
