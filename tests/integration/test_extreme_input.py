"""Times at the ends of the calendar and text PostgreSQL cannot hold get a 4xx naming the field.

A time in year 1 or 9999 with an offset of up to ±23:59 parses, yet is past the calendar's end once
in UTC (chimes.instants); a NUL is valid JSON that PostgreSQL text refuses. Each was an answer of
500 on some route. The explicit cases come first; the property test after them throws generated
extreme times and NUL-bearing text at every route that takes a time or free text, and asserts that
no answer is a 5xx.
"""

from __future__ import annotations

import base64
import string
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from chimes.scheduler.firing import plan_fires
from chimes.store.scheduling import SchedulerStore
from chimes.store.working import ClaimedRun, WorkerStore
from tests.integration.test_fencing import due, make_due_job, take_all
from tests.integration.test_jobs_api import HTTP_TASK, cron_job

pytestmark = pytest.mark.long  # generated extreme times and text against every route

PAST_THE_ENDS = ["9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+23:59", "9999-12-31T23:00:00-01:00",
                 "0001-01-01T00:30:00+00:31"]


@pytest.mark.parametrize("at", PAST_THE_ENDS)
@pytest.mark.parametrize("name", ["since", "until"])
async def test_an_audit_time_past_the_calendars_end_is_a_422_naming_it(client: httpx.AsyncClient, name: str,
                                                                      at: str) -> None:
    response = await client.get("/audit", params={name: at})
    assert response.status_code == 422, response.text
    assert response.json()["field"] == name
    assert "not a time Chimes can hold" in response.json()["message"]


async def test_audit_times_at_the_calendars_ends_in_utc_are_read(client: httpx.AsyncClient) -> None:
    response = await client.get("/audit", params={"since": "0001-01-01T00:00:00Z", "until": "9999-12-31T23:59:59Z"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("at", PAST_THE_ENDS)
async def test_a_preview_from_a_time_past_the_calendars_end_is_a_422_naming_it(client: httpx.AsyncClient,
                                                                              at: str) -> None:
    response = await client.post("/schedules/preview", json={"schedule": {"cron": "0 2 * * *"}, "after": at})
    assert response.status_code == 422, response.text
    assert response.json()["field"] == "after"


async def test_a_notification_cursor_forged_past_the_calendars_end_is_a_400(client: httpx.AsyncClient) -> None:
    forged = base64.urlsafe_b64encode(f"9999-12-31T23:59:59-23:59|{uuid.uuid4()}".encode()).decode().rstrip("=")
    response = await client.get("/notifications", params={"cursor": forged})
    assert response.status_code == 400, response.text
    assert response.json()["field"] == "cursor"


async def leased_callback_run(pool: asyncpg.Pool) -> ClaimedRun:
    """A run of team-a's callback task, claimed by a worker: its target holds the lease token."""
    await make_due_job(pool, {"at": (datetime.now(UTC) - timedelta(seconds=1)).isoformat()}, callback=True)
    store = SchedulerStore(pool, "node")
    leases = await take_all(store)
    await store.fire(leases, plan_fires(await due(store, leases)), datetime.now(UTC))
    [run] = await WorkerStore(pool, "worker-1").claim(1, lease_sec=30, deadline_grace_sec=30)
    return run


@pytest.mark.single_database("claims a run on one database")
@pytest.mark.parametrize("field", ["error", "output"])
async def test_a_callback_report_with_a_nul_is_a_422_naming_the_field_and_changes_nothing(
    client: httpx.AsyncClient, pool: asyncpg.Pool, field: str
) -> None:
    run = await leased_callback_run(pool)
    report = {"leaseToken": str(run.lease_token), "status": "failed", field: "disk\u0000full"}
    response = await client.post(f"/runs/{run.run_id}/complete", json=report)
    assert response.status_code == 422, response.text
    assert response.json()["field"] == field
    assert "NUL" in response.json()["message"]
    assert await pool.fetchval("SELECT status FROM runs WHERE run_id = $1", run.run_id) == "running"
    done = await client.post(f"/runs/{run.run_id}/complete", json=report | {field: "disk full"})
    assert done.status_code == 200, "the lease is still the target's"


# The property test: generated extreme times and hostile text at every route that takes them.

def _time_text(year: int, month: int, day: int, hour: int, minute: int, second: int, fraction: str,
               offset: str) -> str:
    return f"{year:04d}-{month:02d}-{day:02d}T{hour:02d}:{minute:02d}:{second:02d}{fraction}{offset}"


_OFFSETS = st.one_of(st.just("Z"), st.builds(lambda sign, h, m: f"{sign}{h:02d}:{m:02d}", st.sampled_from("+-"),
                                             st.sampled_from([0, 1, 12, 14, 23, 24]), st.sampled_from([0, 30, 59, 60])))
EXTREME_TIMES = st.one_of(
    st.sampled_from([*PAST_THE_ENDS, "9999-12-31T23:59:59.999999Z", "0001-01-01T00:00:00Z",
                     "2016-12-31T23:59:60Z", "1970-01-01T00:00:00Z", "2038-01-19T03:14:08Z"]),
    st.builds(_time_text, st.sampled_from([1, 2, 1969, 1970, 2026, 9998, 9999]), st.sampled_from([1, 2, 12]),
              st.sampled_from([1, 28, 29, 31]), st.sampled_from([0, 23, 24]), st.sampled_from([0, 59]),
              st.sampled_from([0, 59, 60]),
              st.one_of(st.just(""), st.text(string.digits, min_size=1, max_size=40).map(lambda d: "." + d)),
              _OFFSETS),
)
HOSTILE_TEXT = st.one_of(
    st.text(max_size=30).map(lambda t: t + "\u0000"),
    st.text(max_size=30),
    st.sampled_from(["\u0000", "a\u0000b", "\ud800", "\u0000" * 100, "x" * 5000]),
)


Request = dict[str, Any]


def _routes(job_id: str, run: ClaimedRun) -> dict[str, Any]:
    """Every route that takes a time or free text: its name and a function of (time, text) to a request."""
    token = str(run.lease_token)
    return {
        "GET /audit since": lambda t, s: {"method": "GET", "url": "/audit", "params": {"since": t}},
        "GET /audit until": lambda t, s: {"method": "GET", "url": "/audit", "params": {"until": t}},
        "GET /audit actor, action": lambda t, s: {"method": "GET", "url": "/audit",
                                                  "params": {"actor": s, "action": s}},
        "GET /jobs tag, namePrefix": lambda t, s: {"method": "GET", "url": "/jobs",
                                                   "params": {"tag": s, "namePrefix": s}},
        "POST /schedules/preview after": lambda t, s: {
            "method": "POST", "url": "/schedules/preview", "json": {"schedule": {"cron": "0 2 * * *"}, "after": t}},
        "POST /schedules/preview at": lambda t, s: {
            "method": "POST", "url": "/schedules/preview", "json": {"schedule": {"at": t}}},
        "POST /schedules/preview startAt, endAt": lambda t, s: {
            "method": "POST", "url": "/schedules/preview",
            "json": {"schedule": {"cron": "0 2 * * *", "startAt": t, "endAt": t}}},
        "POST /jobs at, name": lambda t, s: {"method": "POST", "url": "/jobs",
                                             "json": cron_job(name=s, schedule={"at": t})},
        "POST /jobs startAt, endAt": lambda t, s: {
            "method": "POST", "url": "/jobs", "json": cron_job(schedule={"cron": "0 2 * * *", "startAt": t,
                                                                         "endAt": t})},
        "POST /jobs text fields": lambda t, s: {"method": "POST", "url": "/jobs", "json": cron_job(
            tags=[s], notifyUrl=f"http://127.0.0.1:9/{s}",
            task={**HTTP_TASK, "url": f"http://127.0.0.1:9/{s}", "headers": {"X-Note": s}, "body": {s: s}})},
        "PATCH /jobs/{id} at": lambda t, s: {"method": "PATCH", "url": f"/jobs/{job_id}",
                                             "json": {"schedule": {"at": t}}},
        "PATCH /jobs/{id} endAt, pauseNote": lambda t, s: {
            "method": "PATCH", "url": f"/jobs/{job_id}",
            "json": {"schedule": {"cron": "0 2 * * *", "endAt": t}, "paused": True, "pauseNote": s}},
        "POST /jobs/{id}/backfill": lambda t, s: {"method": "POST", "url": f"/jobs/{job_id}/backfill",
                                                  "json": {"start": t, "end": t}},
        "POST /runs/{id}/complete": lambda t, s: {
            "method": "POST", "url": f"/runs/{run.run_id}/complete",
            "json": {"leaseToken": token, "status": "failed", "error": s, "output": s}},
        "POST /runs/{id}/heartbeat": lambda t, s: {"method": "POST", "url": f"/runs/{run.run_id}/heartbeat",
                                                   "json": {"leaseToken": s}},
        "GET /ui/jobs q": lambda t, s: {"method": "GET", "url": "/ui/jobs", "params": {"q": s}},
        "POST /ui/login token": lambda t, s: {"method": "POST", "url": "/ui/login", "data": {"token": s}},
    }


ROUTES = ["GET /audit since", "GET /audit until", "GET /audit actor, action", "GET /jobs tag, namePrefix",
          "POST /schedules/preview after", "POST /schedules/preview at", "POST /schedules/preview startAt, endAt",
          "POST /jobs at, name", "POST /jobs startAt, endAt", "POST /jobs text fields", "PATCH /jobs/{id} at",
          "PATCH /jobs/{id} endAt, pauseNote", "POST /jobs/{id}/backfill", "POST /runs/{id}/complete",
          "POST /runs/{id}/heartbeat", "GET /ui/jobs q", "POST /ui/login token"]


@pytest.fixture
async def routes(client: httpx.AsyncClient, pool: asyncpg.Pool, tokens: dict[str, str]) -> dict[str, Any]:
    """The routes, aimed at a job of team-a's and at a callback run whose lease it holds."""
    job_id = (await client.post("/jobs", json=cron_job())).json()["jobId"]
    run = await leased_callback_run(pool)
    client.cookies.set("chimes_session", tokens["team-a"])  # for the dashboard's routes
    built = _routes(job_id, run)
    assert list(built) == ROUTES
    return built


def _each_route(test: Any) -> Any:
    """An explicit example for each route (Hypothesis runs them first): a time past the calendar's end
    and a NUL, so that every route is tried with both whatever else is generated."""
    for route in ROUTES:
        test = example(route=route, at=PAST_THE_ENDS[0], text="a\u0000b")(test)
    return test


@pytest.mark.single_database("claims a run on one database")
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), at=EXTREME_TIMES, text=HOSTILE_TEXT)
@_each_route
async def test_no_extreme_time_or_hostile_text_gets_a_5xx(client: httpx.AsyncClient, routes: dict[str, Any],
                                                          route: str, at: str, text: str) -> None:
    try:
        response = await client.request(**routes[route](at, text))
    except UnicodeEncodeError:  # a lone surrogate: no client can put it in a URL or a form
        return
    assert response.status_code < 500, f"{route} with {at!r} and {text!r}: {response.status_code} {response.text}"
