"""Isolation: every endpoint, tried as another team, with a read-only token, with a revoked token and
with no token, gives the right refusal, and the refused calls change nothing.

The table names every route of the app; a route that is not in it fails the first test, so a new
endpoint cannot be added without saying who may call it.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx
import pytest
from fastapi import routing

from chimes.api.app import create_app
from chimes.dashboard.session import COOKIE, csrf_token
from chimes.store.tokens import create_token, hash_token
from tests.helpers import Homes, auth_as

AS_OTHER_TEAM, READ_ONLY, REVOKED, NO_TOKEN = "other-team", "read-only", "revoked", "no-token"
CALLERS = (AS_OTHER_TEAM, READ_ONLY, REVOKED, NO_TOKEN)


@dataclass(frozen=True)
class Kind:
    """What each kind of caller gets from one kind of endpoint (status codes)."""

    other_team: int
    read_only: int
    revoked: int
    no_token: int

    def expected(self, caller: str) -> int:
        return {AS_OTHER_TEAM: self.other_team, READ_ONLY: self.read_only, REVOKED: self.revoked,
                NO_TOKEN: self.no_token}[caller]


# API.md: no or bad token 401; another team's job or run answers 404 as if it did not exist; a
# read-only token that tries to change something gets 403.
API_READ_OWN = Kind(other_team=404, read_only=200, revoked=401, no_token=401)
API_WRITE_OWN = Kind(other_team=404, read_only=403, revoked=401, no_token=401)
API_LIST = Kind(other_team=200, read_only=200, revoked=401, no_token=401)   # lists only the caller's own
API_CREATE = Kind(other_team=201, read_only=403, revoked=401, no_token=401)  # creates for the caller's team
PUBLIC = Kind(other_team=200, read_only=200, revoked=200, no_token=200)
REDIRECT = Kind(other_team=303, read_only=303, revoked=303, no_token=303)
# The dashboard: no valid session redirects to the login page; forms of a read-only token are refused.
ADMIN_ONLY = Kind(other_team=403, read_only=403, revoked=401, no_token=401)  # fleet-wide: admins only
# A callback with the right lease token of another team's run: refused exactly as for a run that
# does not exist (409, stale lease), so it tells nothing about team A's run.
CALLBACK_OWN = Kind(other_team=409, read_only=403, revoked=401, no_token=401)
UI_PAGE_OWN = Kind(other_team=404, read_only=200, revoked=303, no_token=303)
UI_PAGE_SHARED = Kind(other_team=200, read_only=200, revoked=303, no_token=303)
UI_ACTION_OWN = Kind(other_team=404, read_only=403, revoked=303, no_token=303)
UI_LOGIN = Kind(other_team=303, read_only=303, revoked=401, no_token=401)   # signs in valid tokens only
UI_LOGOUT = Kind(other_team=303, read_only=303, revoked=303, no_token=403)  # needs a session's CSRF token

ROUTES: dict[tuple[str, str], Kind] = {
    ("GET", "/openapi.json"): PUBLIC,
    ("GET", "/healthz"): PUBLIC,
    ("GET", "/metrics"): PUBLIC,  # fleet-wide numbers only: no job, run or owner in them
    ("POST", "/jobs"): API_CREATE,
    ("GET", "/jobs"): API_LIST,
    ("GET", "/jobs/{job_id}"): API_READ_OWN,
    ("PATCH", "/jobs/{job_id}"): API_WRITE_OWN,
    ("DELETE", "/jobs/{job_id}"): API_WRITE_OWN,
    ("GET", "/jobs/{job_id}/runs"): API_READ_OWN,
    ("POST", "/jobs/{job_id}/runs"): API_WRITE_OWN,
    ("GET", "/runs/{run_id}"): API_READ_OWN,
    ("POST", "/runs/{run_id}/rerun"): API_WRITE_OWN,
    ("POST", "/runs/{run_id}/cancel"): API_WRITE_OWN,
    ("POST", "/jobs/{job_id}/backfill"): API_WRITE_OWN,
    ("POST", "/runs/{run_id}/heartbeat"): CALLBACK_OWN,
    ("POST", "/runs/{run_id}/complete"): CALLBACK_OWN,
    ("GET", "/queue"): ADMIN_ONLY,
    ("GET", "/notifications"): API_LIST,
    ("GET", "/whoami"): API_LIST,  # the caller's own owner and scope
    ("GET", "/audit"): API_LIST,  # the entries of the caller's own jobs (every entry for an admin)
    ("GET", "/jobs/{job_id}/pauses"): API_READ_OWN,
    ("POST", "/schedules/preview"): API_LIST,  # computes and changes nothing: any valid token, read-only too
    ("GET", "/calendars"): API_LIST,
    ("GET", "/calendars/{name}"): API_READ_OWN,  # another team has none by that name: 404
    ("DELETE", "/calendars/{name}"): API_WRITE_OWN,  # before PUT: another team's PUT makes its own of that name
    ("PUT", "/calendars/{name}"): API_CREATE,  # creates the caller's own calendar of that name
    ("GET", "/"): REDIRECT,
    ("GET", "/ui"): REDIRECT,
    ("GET", "/ui/static/htmx.min.js"): PUBLIC,  # the mount /ui/static: files shipped with Chimes
    ("GET", "/ui/login"): PUBLIC,
    ("POST", "/ui/login"): UI_LOGIN,
    ("POST", "/ui/logout"): UI_LOGOUT,
    ("GET", "/ui/jobs"): UI_PAGE_SHARED,
    ("GET", "/ui/fleet"): UI_PAGE_SHARED,
    ("GET", "/ui/jobs/{job_id}"): UI_PAGE_OWN,
    ("GET", "/ui/runs/{run_id}"): UI_PAGE_OWN,
    ("POST", "/ui/jobs/{job_id}/run"): UI_ACTION_OWN,
    ("POST", "/ui/jobs/{job_id}/pause"): UI_ACTION_OWN,
    ("POST", "/ui/jobs/{job_id}/resume"): UI_ACTION_OWN,
    ("POST", "/ui/runs/{run_id}/rerun"): UI_ACTION_OWN,
    ("POST", "/ui/runs/{run_id}/cancel"): UI_ACTION_OWN,
}
CALENDAR = "team-a-days"  # team A's calendar in the world
MOUNTS = {"/ui/static": "/ui/static/htmx.min.js"}


def app_routes() -> set[tuple[str, str]]:
    found = set()
    for context in routing.iter_route_contexts(create_app("postgresql://unused/db").routes):
        if not context.methods:  # a mount: its table entry is one file under it
            found.add(("GET", MOUNTS.get(context.path, context.path)))
        found.update((method, context.path) for method in context.methods or () if method != "HEAD")
    return found


def test_every_route_of_the_app_is_in_the_table() -> None:
    missing = app_routes() - set(ROUTES)
    assert not missing, f"routes with no isolation expectation: {sorted(missing)}; add them to ROUTES"
    gone = set(ROUTES) - app_routes()
    assert not gone, f"the table names routes the app no longer has: {sorted(gone)}"


@dataclass
class World:
    api_url: str
    job_id: str
    run_id: str
    lease_token: str  # of the run, which an outside executor is working on (a callback task)
    tokens: dict[str, str | None]  # caller -> the token it presents


@pytest.fixture
async def world(api_url: str, pool: asyncpg.Pool, homes: Homes, tokens: dict[str, str]) -> AsyncIterator[World]:
    """Team A's job (paused, so nothing fires) and a manual run of it; the tokens of every caller."""
    async with pool.acquire() as conn:
        read_only = await create_token(conn, "team-a", scope="read")
        revoked = await create_token(conn, "team-a")
        await conn.execute("UPDATE api_tokens SET revoked_at = now() WHERE token_hash = $1", hash_token(revoked))
    async with httpx.AsyncClient(base_url=api_url, headers=auth_as(tokens["team-a"])) as http:
        assert (await http.put(f"/calendars/{CALENDAR}", json={"timezone": "UTC", "dates": []})).status_code == 201
        job = await http.post("/jobs", json=_job("team-a job"))
        job_id = job.json()["jobId"]
        assert (await http.patch(f"/jobs/{job_id}", json={"paused": True})).status_code == 200
        run_id = (await http.post(f"/jobs/{job_id}/runs")).json()["runId"]
    lease_token = str(uuid.uuid4())
    pool = await homes.for_job(job_id)  # the job's database, its runs' and notifications'
    # A dead-lettered notification of team A's job: the lists of other teams must not show it.
    await pool.execute("INSERT INTO notifications (notification_id, job_id, owner, kind, url, payload, dead_at,"
                       " last_error) VALUES (gen_random_uuid(), $1, 'team-a', 'run_failed', 'http://127.0.0.1:9/',"
                       " '{}', now(), 'HTTP 500')", uuid.UUID(job_id))
    await pool.execute("DELETE FROM run_queue WHERE run_id = $1", uuid.UUID(run_id))
    await pool.execute("UPDATE runs SET status = 'running', lease_token = $2, started_at = now() WHERE run_id = $1",
                       uuid.UUID(run_id), lease_token)
    await pool.execute("INSERT INTO run_leases (run_id, scheduled_at, partition_id, token, expires_at, deadline_at)"
                       " SELECT run_id, scheduled_at, partition_id, lease_token, now() + interval '1 hour',"
                       " now() + interval '2 hours' FROM runs WHERE run_id = $1", uuid.UUID(run_id))
    yield World(api_url, job_id, run_id, lease_token, {AS_OTHER_TEAM: tokens["team-b"], READ_ONLY: read_only,
                                                       REVOKED: revoked, NO_TOKEN: None})


def _job(name: str) -> dict:
    at = (datetime.now(UTC) + timedelta(days=30)).isoformat()
    return {"name": name, "schedule": {"at": at}, "task": {"type": "http", "url": "http://127.0.0.1:9/none"}}


async def _call(http: httpx.AsyncClient, world: World, method: str, path: str, token: str | None) -> httpx.Response:
    url = path.replace("{job_id}", world.job_id).replace("{run_id}", world.run_id).replace("{name}", CALENDAR)
    http.cookies.clear()  # a sign-in sets a cookie: no call may carry one it was not given
    if path.startswith("/ui"):
        headers = {"Cookie": f"{COOKIE}={token}"} if token else {}
    else:
        headers = auth_as(token) if token else {}
    if path == "/ui/login":
        if method == "GET":
            return await http.get(url)
        return await http.post(url, data={"token": token or "", "next": "/ui/jobs"})
    if path.startswith("/ui") and method == "POST":
        return await http.post(url, data={"csrf": csrf_token(token) if token else ""}, headers=headers)
    past = datetime.now(UTC) - timedelta(days=1)
    body = {
        "/jobs": _job("made by the caller"),
        "/jobs/{job_id}": {"name": "renamed by the caller"},
        "/jobs/{job_id}/backfill": {"start": (past - timedelta(days=1)).isoformat(), "end": past.isoformat()},
        "/runs/{run_id}/heartbeat": {"leaseToken": world.lease_token},
        "/runs/{run_id}/complete": {"leaseToken": world.lease_token, "status": "succeeded"},
        "/schedules/preview": {"schedule": {"cron": "0 3 * * *"}, "n": 2},
        "/calendars/{name}": {"timezone": "UTC", "dates": ["2031-01-01"]},
    }.get(path)
    if method == "PUT":
        return await http.put(url, json=body, headers=headers)
    return await http.request(method, url, json=body if method in ("POST", "PATCH") else None, headers=headers)


async def test_every_endpoint_refuses_what_is_not_the_callers(world: World, homes: Homes) -> None:
    pool = await homes.for_job(world.job_id)
    before = await _snapshot(pool, world)
    wrong = []
    async with httpx.AsyncClient(base_url=world.api_url, follow_redirects=False, timeout=30) as http:
        for (method, path), kind in ROUTES.items():
            for caller in CALLERS:
                response = await _call(http, world, method, path, world.tokens[caller])
                if response.status_code != kind.expected(caller):
                    wrong.append(f"{method} {path} as {caller}: {response.status_code}, expected "
                                 f"{kind.expected(caller)}: {response.text[:200]}")
                elif kind is API_LIST and caller == AS_OTHER_TEAM:
                    if world.job_id in response.text or CALENDAR in response.text:
                        wrong.append(f"{method} {path} as {caller} shows team A's job or calendar")
                elif caller == READ_ONLY and kind in (API_WRITE_OWN, API_CREATE, CALLBACK_OWN):
                    assert "read-only" in response.json()["message"], response.text
    assert not wrong, "\n".join(wrong)
    # Refused calls wrote nothing: team A's job and run are exactly as they were.
    assert await _snapshot(pool, world) == before


async def test_refusals_are_json_errors_that_say_why(world: World) -> None:
    async with httpx.AsyncClient(base_url=world.api_url) as http:
        read_only = await http.delete(f"/jobs/{world.job_id}", headers=auth_as(world.tokens[READ_ONLY]))
        revoked = await http.get(f"/jobs/{world.job_id}", headers=auth_as(world.tokens[REVOKED]))
        other = await http.get(f"/runs/{world.run_id}", headers=auth_as(world.tokens[AS_OTHER_TEAM]))
    assert read_only.status_code == 403
    assert read_only.json() == {"error": "forbidden", "field": None, "message":
                                "this token is read-only (scope 'read'): DELETE needs a token with scope 'write' "
                                "or 'admin'"}
    assert revoked.status_code == 401 and revoked.json()["message"] == "invalid or revoked token"
    assert revoked.headers["www-authenticate"] == "Bearer"
    assert other.status_code == 404 and other.json()["message"] == "run not found"


async def test_the_owner_and_an_admin_do_get_through(world: World, tokens: dict[str, str]) -> None:
    """The same calls that were refused succeed for the team itself and for an admin: the table's
    refusals come from ownership and scope, not from broken requests."""
    async with httpx.AsyncClient(base_url=world.api_url) as http:
        for token in (tokens["team-a"], tokens["admin"]):
            assert (await http.get(f"/jobs/{world.job_id}", headers=auth_as(token))).status_code == 200
            assert (await http.get(f"/runs/{world.run_id}", headers=auth_as(token))).status_code == 200
            renamed = await http.patch(f"/jobs/{world.job_id}", json={"name": "renamed"}, headers=auth_as(token))
            assert renamed.status_code == 200


async def _snapshot(pool: asyncpg.Pool, world: World) -> tuple:
    job = await pool.fetchrow("SELECT name, paused, version FROM jobs WHERE job_id = $1", world.job_id)
    runs = await pool.fetch("SELECT r.run_id, r.status, l.expires_at FROM runs r LEFT JOIN run_leases l"
                            " ON l.run_id = r.run_id WHERE r.job_id = $1 ORDER BY r.run_id", world.job_id)
    # A refused call records no change (the other team's own create, allowed, is about its own job).
    audited = await pool.fetchval("SELECT count(*) FROM audit_log WHERE job_id = $1", world.job_id)
    return tuple(job), tuple(tuple(r) for r in runs), audited


async def test_token_scope_survives_a_restart_of_the_api(database_url: str, pool: asyncpg.Pool) -> None:
    """Scopes live in the database: a fresh API process enforces them the same way."""
    async with pool.acquire() as conn:
        read_only = await create_token(conn, "team-a", scope="read")
    app = create_app(database_url, pool_size=2)
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://api") as http:
        refused = await http.post("/jobs", json=_job("x"), headers=auth_as(read_only))
        allowed = await http.get("/jobs", headers=auth_as(read_only))
    assert refused.status_code == 403 and allowed.status_code == 200
