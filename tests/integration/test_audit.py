"""The audit trail: every state-changing call leaves one entry (who, when, which request, what changed)
written with the change, readable by admins (``GET /audit``, ``chimes audit``, the job's page) and by
an owner for its own jobs only, kept as long as run history, and never holding a secret."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx
import pytest
from click.testing import CliRunner, Result

from chimes.cli.main import cli
from chimes.scheduler.retention import Retention
from chimes.store.audit import changes
from tests.helpers import Homes, auth_as
from tests.integration.test_dashboard import csrf_of, signed_in

SECRET = "s3cret-value-never-stored-in-clear"


def http_job(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "schedule": {"cron": "0 3 * * *"},
            "task": {"type": "http", "url": "http://127.0.0.1:9/", "secretHeaders": {"Authorization": SECRET}},
            **extra}


async def entries(client: httpx.AsyncClient, token: str, **params: Any) -> list[dict[str, Any]]:
    response = await client.get("/audit", params=params, headers=auth_as(token))
    assert response.status_code == 200, response.text
    found: list[dict[str, Any]] = response.json()["entries"]
    return found


async def create(client: httpx.AsyncClient, body: dict[str, Any], **headers: str) -> str:
    response = await client.post("/jobs", json=body, headers=headers)
    assert response.status_code == 201, response.text
    return str(response.json()["jobId"])


async def test_job_changes_are_recorded_with_who_when_which_request_and_what(
    client: httpx.AsyncClient, tokens: dict[str, str], pool: asyncpg.Pool,
) -> None:
    before = datetime.now(UTC)
    created = await client.post("/jobs", json=http_job("nightly"), headers={"X-Request-Id": "req-create-1"})
    assert created.headers["x-request-id"] == "req-create-1"
    job_id = created.json()["jobId"]
    assert (await client.patch(f"/jobs/{job_id}", json={"schedule": {"cron": "0 4 * * *"}})).status_code == 200
    assert (await client.patch(f"/jobs/{job_id}", json={"paused": True})).status_code == 200
    assert (await client.patch(f"/jobs/{job_id}", json={"paused": False})).status_code == 200
    new_secret = {"task": {"type": "http", "url": "http://127.0.0.1:9/", "secretHeaders": {"Authorization": "x2"}}}
    assert (await client.patch(f"/jobs/{job_id}", json=new_secret)).status_code == 200
    deleted = await client.delete(f"/jobs/{job_id}")
    assert deleted.status_code == 204 and len(deleted.headers["x-request-id"]) == 32

    found = await entries(client, tokens["admin"], jobId=job_id)
    assert [e["action"] for e in found] == ["job.delete", "job.update", "job.resume", "job.pause", "job.update",
                                            "job.create"]
    made = found[-1]
    assert made["requestId"] == "req-create-1" and made["subject"] == f"job {job_id}" and made["owner"] == "team-a"
    assert made["actor"]["owner"] == "team-a" and made["actor"]["tokenId"]
    assert before <= datetime.fromisoformat(made["at"]) <= datetime.now(UTC)
    assert made["changes"]["name"] == {"before": None, "after": "nightly"}
    assert found[-2]["changes"]["schedule"] == {"before": {"cron": "0 3 * * *", "timezone": "UTC", "jitterSec": 0},
                                                "after": {"cron": "0 4 * * *", "timezone": "UTC", "jitterSec": 0}}
    assert list(found[-2]["changes"]) == ["schedule"], "only the fields that changed"
    assert found[-3]["changes"] == {"paused": {"before": False, "after": True}}
    secret_change = found[1]["changes"]["task"]
    assert secret_change["before"]["secretHeaders"] == secret_change["after"]["secretHeaders"] == \
        {"Authorization": "********"}, "a changed secret shows as changed, redacted"
    assert found[0]["changes"]["name"] == {"before": "nightly", "after": None}
    stored = json.dumps([dict(r) for r in await pool.fetch("SELECT changes FROM audit_log")], default=str)
    assert SECRET not in stored and "x2" not in stored and "gAAAA" not in stored, "neither clear nor sealed"


async def test_runs_triggered_rerun_backfilled_and_cancelled_are_recorded(
    client: httpx.AsyncClient, tokens: dict[str, str],
) -> None:
    job_id = await create(client, {"name": "every-minute", "schedule": {"cron": "* * * * *"},
                                   "task": {"type": "http", "url": "http://127.0.0.1:9/"}})
    run_id = (await client.post(f"/jobs/{job_id}/runs")).json()["runId"]
    rerun_id = (await client.post(f"/runs/{run_id}/rerun")).json()["runId"]
    assert (await client.post(f"/runs/{rerun_id}/cancel")).status_code == 200
    now = datetime.now(UTC)
    window = {"start": (now - timedelta(minutes=3)).isoformat(), "end": (now - timedelta(minutes=1)).isoformat()}
    assert (await client.post(f"/jobs/{job_id}/backfill", json=window)).status_code == 202

    found = await entries(client, tokens["admin"], jobId=job_id)
    assert [e["action"] for e in found] == ["job.backfill", "run.cancel", "run.rerun", "run.trigger", "job.create"]
    backfill, cancel, rerun, trigger = found[:4]
    assert trigger["subject"] == f"run {run_id}" and trigger["changes"]["trigger"]["after"] == "manual"
    assert rerun["subject"] == f"run {rerun_id}" and rerun["changes"]["trigger"]["after"] == "rerun"
    assert cancel["changes"]["status"] == {"before": "scheduled", "after": "cancelled"}
    assert backfill["changes"]["created"]["after"] == 2 and backfill["owner"] == "team-a"


async def test_a_change_that_is_refused_leaves_no_entry(client: httpx.AsyncClient, tokens: dict[str, str]) -> None:
    job_id = await create(client, http_job("guarded"))
    stale = await client.patch(f"/jobs/{job_id}", json={"name": "x"}, headers={"If-Match": '"99"'})
    assert stale.status_code == 412
    invalid = await client.patch(f"/jobs/{job_id}", json={"schedule": {"cron": "not a cron"}})
    assert invalid.status_code == 422
    assert (await client.delete(f"/jobs/{job_id}", headers={"If-Match": '"7"'})).status_code == 412
    assert [e["action"] for e in await entries(client, tokens["admin"], jobId=job_id)] == ["job.create"]


async def test_an_owner_reads_only_its_own_jobs_entries_and_an_admin_reads_all(
    client: httpx.AsyncClient, tokens: dict[str, str],
) -> None:
    mine = await create(client, http_job("mine"))
    theirs = (await client.post("/jobs", json=http_job("theirs"), headers=auth_as(tokens["team-b"]))).json()["jobId"]
    assert {e["jobId"] for e in await entries(client, tokens["team-a"])} == {mine}
    assert {e["jobId"] for e in await entries(client, tokens["team-b"])} == {theirs}
    assert await entries(client, tokens["team-a"], jobId=theirs) == [], "another owner's job: nothing, not an error"
    assert {e["jobId"] for e in await entries(client, tokens["admin"])} == {mine, theirs}
    assert [e["jobId"] for e in await entries(client, tokens["admin"], actor="team-b")] == [theirs]
    assert (await client.get("/audit", params={"since": "yesterday"})).status_code == 422
    assert (await client.get("/audit", params={"actor": "a\x00"})).json()["field"] == "actor"
    assert (await client.get("/audit", params={"cursor": "nonsense"})).status_code == 400


async def test_filters_by_action_and_time_and_pages_with_a_cursor(
    client: httpx.AsyncClient, tokens: dict[str, str],
) -> None:
    start = datetime.now(UTC)
    job_ids = [await create(client, http_job(f"job-{n}")) for n in range(5)]
    await client.patch(f"/jobs/{job_ids[0]}", json={"paused": True})
    admin = tokens["admin"]
    assert [e["jobId"] for e in await entries(client, admin, action="job.pause")] == [job_ids[0]]
    assert await entries(client, admin, until=start.isoformat()) == []
    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": 2, "action": "job.create", "since": start.isoformat()}
        if cursor:
            params["cursor"] = cursor
        page = (await client.get("/audit", params=params, headers=auth_as(admin))).json()
        seen += [e["jobId"] for e in page["entries"]]
        cursor = page["nextCursor"]
        if cursor is None:
            break
    assert seen == job_ids[::-1], "newest first, each entry once"


async def invoke(database_url: str, *args: str) -> Result:
    result = await asyncio.to_thread(CliRunner().invoke, cli, list(args),
                                     env={"CHIMES_DATABASE_URL": database_url, "CHIMES_LOG_LEVEL": "WARNING"})
    assert result.exit_code == 0, result.output
    return result


async def test_operator_commands_are_recorded_without_secrets(
    database_url: str, client: httpx.AsyncClient, tokens: dict[str, str], pool: asyncpg.Pool,
) -> None:
    token = (await invoke(database_url, "token", "create", "--owner", "team-c", "--name", "ci")).output.strip()
    token_id = await pool.fetchval("SELECT token_id FROM api_tokens WHERE name = 'ci'")
    await invoke(database_url, "token", "revoke", str(token_id))
    await invoke(database_url, "cap", "set", "owner:team-c", "5")
    await invoke(database_url, "cap", "set", "owner:team-c", "7")
    await invoke(database_url, "cap", "remove", "owner:team-c")
    await invoke(database_url, "owner", "set", "team-c", "--allow-commands", "--job-quota", "3")
    signing = (await invoke(database_url, "owner", "signing-secret", "team-c", "--rotate")).output.strip()

    found = await entries(client, tokens["admin"])
    by_action = {e["action"]: e for e in found}
    assert [e["action"] for e in found] == ["owner.signing_secret", "owner.update", "cap.delete", "cap.set",
                                            "cap.set", "token.revoke", "token.create"]
    made = by_action["token.create"]
    assert made["subject"] == f"token {token_id}" and made["owner"] == "team-c"
    assert made["actor"]["owner"] == "operator" and made["actor"]["tokenId"] is None
    assert "@" in made["actor"]["tokenName"], "the user and host of the command line"
    assert made["changes"]["scope"] == {"before": None, "after": "write"}
    assert found[3]["changes"] == {"maxRunning": {"before": 5, "after": 7}}
    assert by_action["cap.delete"]["changes"] == {"maxRunning": {"before": 7, "after": None}}
    assert by_action["owner.update"]["changes"] == {"allowCommands": {"before": False, "after": True},
                                                    "jobQuota": {"before": None, "after": 3}}
    assert by_action["token.revoke"]["changes"]["revokedAt"]["after"] is not None
    text = json.dumps(found)
    assert token not in text and signing not in text and "chm_" not in text
    assert await entries(client, tokens["team-a"]) == [], "an owner does not read the operator's entries"
    listing = await invoke(database_url, "audit", "--action", "cap.set", "--api-url", str(client.base_url),
                           "--token", tokens["admin"], "--json")
    assert [e["changes"]["maxRunning"]["after"] for e in json.loads(listing.output)["entries"]] == [7, 5]


async def test_dashboard_actions_are_recorded_and_the_job_page_shows_its_entries(
    api_url: str, client: httpx.AsyncClient, tokens: dict[str, str],
) -> None:
    job_id = await create(client, http_job("from-the-dashboard"))
    other = (await client.post("/jobs", json=http_job("other"), headers=auth_as(tokens["team-b"]))).json()["jobId"]
    async with signed_in(api_url, tokens["team-a"]) as browser:
        page = await browser.get(f"/ui/jobs/{job_id}")
        assert (await browser.post(f"/ui/jobs/{job_id}/pause", data={"csrf": csrf_of(page.text)})).status_code == 303
        page = (await browser.get(f"/ui/jobs/{job_id}")).text
    assert "job.pause" in page and "job.create" in page and SECRET not in page
    assert other not in page
    found = await entries(client, tokens["admin"], jobId=job_id)
    assert [e["action"] for e in found] == ["job.pause", "job.create"]


async def test_entries_are_kept_as_long_as_run_history(
    client: httpx.AsyncClient, tokens: dict[str, str], homes: Homes,
) -> None:
    job_id = await create(client, http_job("kept"))
    for home in await homes.homes():
        await home.execute("UPDATE audit_log SET at = at - interval '40 days' WHERE job_id <> $1", uuid.UUID(job_id))
    await create(client, http_job("newer"))
    for home in await homes.homes():
        await home.execute("UPDATE audit_log SET at = at - interval '40 days' WHERE job_id = $1", uuid.UUID(job_id))
    deleted = sum([(await Retention(home, days=30).sweep(datetime.now(UTC))).audit_entries_deleted
                   for home in await homes.homes()])
    assert deleted == 1
    assert [e["changes"]["name"]["after"] for e in await entries(client, tokens["admin"])] == ["newer"]


@pytest.mark.parametrize(("before", "after", "expected"), [
    (None, {"a": 1}, {"a": {"before": None, "after": 1}}),
    ({"a": 1, "b": 2}, {"a": 1, "b": 3}, {"b": {"before": 2, "after": 3}}),
    ({"a": 1}, None, {"a": {"before": 1, "after": None}}),
    ({"a": 1}, {"a": 1}, {}),
])
def test_changes_keep_only_the_fields_that_differ(before: Any, after: Any, expected: dict[str, Any]) -> None:
    assert changes(before, after) == expected


async def test_calendar_edits_and_a_pause_note_are_recorded(client: httpx.AsyncClient, tokens: dict[str, str]) -> None:
    holidays = {"timezone": "Europe/Berlin", "dates": ["2026-12-25"]}
    assert (await client.put("/calendars/holidays", json=holidays)).status_code == 201
    assert (await client.put("/calendars/holidays", json={**holidays, "dates": ["2026-12-26"]})).status_code == 200
    assert (await client.delete("/calendars/holidays")).status_code == 204
    job_id = await create(client, http_job("noted"))
    paused = await client.patch(f"/jobs/{job_id}", json={"paused": True, "pauseNote": "incident 123"})
    assert paused.status_code == 200, paused.text

    edits = [e for e in await entries(client, tokens["team-a"]) if e["subject"] == "calendar holidays"]
    assert [e["action"] for e in edits] == ["calendar.delete", "calendar.put", "calendar.put"]
    assert edits[2]["changes"]["dates"] == {"before": None, "after": ["2026-12-25"]}
    assert edits[1]["changes"] == {"dates": {"before": ["2026-12-25"], "after": ["2026-12-26"]}}
    assert edits[0]["changes"]["timezone"] == {"before": "Europe/Berlin", "after": None}
    assert all(e["owner"] == "team-a" for e in edits)
    assert [e for e in await entries(client, tokens["team-b"]) if e["subject"] == "calendar holidays"] == [], \
        "another owner's calendar is not shown"
    pause = (await entries(client, tokens["team-a"], jobId=job_id, action="job.pause"))[0]
    assert pause["changes"] == {"paused": {"before": False, "after": True},
                                "pauseNote": {"before": None, "after": "incident 123"}}
