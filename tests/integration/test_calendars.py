"""Exclusion calendars through the real API and scheduler: owned per team like jobs, named by jobs,
a slot they exclude recorded as skipped with the calendar named, edits felt within seconds, a
calendar in use not deleted, previews that leave excluded days out."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import httpx

from tests.helpers import Homes, auth_as, wait_for
from tests.integration.fleet import Fleet
from tests.integration.test_apply import chimes
from tests.integration.test_semantics import job
from tests.target import Target


async def test_calendars_are_an_owners_own_and_bad_ones_are_refused(
    client: httpx.AsyncClient, tokens: dict[str, str]
) -> None:
    made = await client.put("/calendars/holidays", json={"timezone": "Europe/Berlin",
                                                        "dates": ["2026-12-25", "2026-12-26"]})
    assert made.status_code == 201, made.text
    assert made.json()["dates"] == ["2026-12-25", "2026-12-26"] and made.json()["owner"] == "team-a"
    replaced = await client.put("/calendars/holidays", json={"timezone": "Europe/Berlin", "dates": ["2027-01-01"]})
    assert replaced.status_code == 200 and replaced.json()["version"] > made.json()["version"]
    assert [c["name"] for c in (await client.get("/calendars")).json()["calendars"]] == ["holidays"]
    other_team = auth_as(tokens["team-b"])
    assert (await client.get("/calendars/holidays", headers=other_team)).status_code == 404
    assert (await client.get("/calendars", headers=other_team)).json()["calendars"] == []
    for body, field in [({"timezone": "Mars/Base"}, "timezone"), ({"dates": ["2026-02-30"]}, "dates.0"),
                        ({"windows": [{"start": "2026-12-02T00:00:00Z", "end": "2026-12-01T00:00:00Z"}]},
                         "windows.0")]:
        refused = await client.put("/calendars/bad", json=body)
        assert refused.status_code == 422 and refused.json()["field"] == field, refused.text
    assert (await client.get("/calendars/bad")).status_code == 404


async def test_a_job_naming_an_unknown_calendar_is_refused_and_nothing_written(
    client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    response = await client.post("/jobs", json=job(target, "/x", {"cron": "@daily", "excludeCalendars": ["nope"]}))
    assert response.status_code == 422, response.text
    assert response.json()["field"] == "schedule.excludeCalendars" and "'nope'" in response.json()["message"]
    assert await homes.total("SELECT count(*) FROM jobs") == 0


async def test_an_excluded_slot_is_recorded_skipped_naming_the_calendar_and_edits_apply_within_seconds(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    assert (await client.put("/calendars/freeze", json={"windows": []})).status_code == 201
    created = await client.post("/jobs", json=job(target, "/frozen", {"everySec": 1, "excludeCalendars": ["freeze"]},
                                                  concurrency="allow"))
    assert created.status_code == 201, created.text
    job_id = created.json()["jobId"]
    pool = await homes.for_job(job_id)
    await wait_for(lambda: _count(pool, job_id, "succeeded", 1), timeout=20, what="a run before the freeze")
    frozen_from = datetime.now(UTC)
    window = {"start": frozen_from.isoformat(), "end": (frozen_from + timedelta(hours=1)).isoformat()}
    assert (await client.put("/calendars/freeze", json={"windows": [window]})).status_code == 200
    await wait_for(lambda: _count(pool, job_id, "skipped", 3), timeout=15, what="slots skipped by the freeze")
    skipped = await pool.fetch("SELECT * FROM runs WHERE job_id = $1 AND status = 'skipped'", uuid.UUID(job_id))
    assert all(r["reason"] == "excluded by calendar freeze" and r["scheduled_at"] >= frozen_from for r in skipped)
    # Within the refresh time every slot is skipped: none of the last three ran.
    history = await pool.fetch("SELECT status FROM runs WHERE job_id = $1 ORDER BY scheduled_at DESC LIMIT 3",
                               uuid.UUID(job_id))
    assert [r["status"] for r in history] == ["skipped"] * 3
    assert (await client.patch(f"/jobs/{job_id}", json={"paused": True})).status_code == 200


async def _count(pool: asyncpg.Pool, job_id: str, status: str, at_least: int) -> bool:
    return await pool.fetchval("SELECT count(*) FROM runs WHERE job_id = $1 AND status = $2", uuid.UUID(job_id),
                               status) >= at_least


async def test_a_calendar_in_use_is_not_deleted_and_previews_leave_its_days_out(
    client: httpx.AsyncClient, target: Target
) -> None:
    tomorrow = (datetime.now(UTC) + timedelta(days=1)).date()
    await client.put("/calendars/days-off", json={"dates": [tomorrow.isoformat()]})
    created = await client.post("/jobs", json=job(target, "/daily", {"cron": "0 12 * * *",
                                                                    "excludeCalendars": ["days-off"]}))
    job_id = created.json()["jobId"]
    previewed = (await client.get(f"/jobs/{job_id}", params={"preview": 3})).json()["nextRuns"]
    assert tomorrow.isoformat() not in " ".join(previewed) and len(previewed) == 3
    unsaved = await client.post("/schedules/preview", json={
        "schedule": {"cron": "0 12 * * *", "excludeCalendars": ["days-off"]}, "n": 3})
    assert unsaved.json()["fires"] == previewed
    unknown = await client.post("/schedules/preview", json={"schedule": {"cron": "@daily", "excludeCalendars": ["x"]}})
    assert unknown.status_code == 422 and unknown.json()["field"] == "schedule.excludeCalendars"
    refused = await client.delete("/calendars/days-off")
    assert refused.status_code == 409 and job_id in refused.json()["message"], refused.text
    assert (await client.get("/calendars/days-off")).status_code == 200
    assert (await client.delete(f"/jobs/{job_id}")).status_code == 204
    assert (await client.delete("/calendars/days-off")).status_code == 204
    assert (await client.get("/calendars/days-off")).status_code == 404


async def test_the_cli_puts_lists_and_deletes_calendars(api_url: str, tokens: dict[str, str]) -> None:
    token = tokens["team-a"]
    made = await chimes(api_url, token, "calendars", "put", "holidays", "--timezone", "Europe/Berlin",
                        "--date", "2026-12-25", "--window", "2026-12-31T18:00:00+01:00/2027-01-01T12:00:00+01:00")
    assert made.exit_code == 0 and "1 days, 1 windows" in made.output, made.output
    listed = await chimes(api_url, token, "calendars", "list")
    assert listed.exit_code == 0 and listed.output.startswith("holidays\tEurope/Berlin")
    created = await chimes(api_url, token, "jobs", "create", "--name", "j", "--cron", "@daily",
                           "--exclude-calendar", "holidays", "--url", "http://127.0.0.1:9/")
    assert created.exit_code == 0, created.output
    refused = await chimes(api_url, token, "calendars", "delete", "holidays")
    assert refused.exit_code != 0 and "excludeCalendars" in refused.output


async def test_apply_makes_the_calendars_its_jobs_name_and_reapplying_changes_nothing(
    api_url: str, tokens: dict[str, str], client: httpx.AsyncClient, tmp_path: Path
) -> None:
    path = tmp_path / "jobs.yaml"
    path.write_text(APPLIED)
    first = await chimes(api_url, tokens["team-a"], "apply", "-f", str(path))
    assert first.exit_code == 0, first.output
    assert "create    calendar holidays" in first.output
    assert (await client.get("/calendars/holidays")).json()["dates"] == ["2026-12-25"]
    again = await chimes(api_url, tokens["team-a"], "apply", "-f", str(path))
    assert again.exit_code == 0 and "unchanged calendar holidays" in again.output and "1 unchanged" in again.output
    path.write_text(APPLIED.replace("2026-12-25", "2026-12-24"))
    changed = await chimes(api_url, tokens["team-a"], "apply", "-f", str(path))
    assert changed.exit_code == 0 and "update    calendar holidays" in changed.output
    assert (await client.get("/calendars/holidays")).json()["dates"] == ["2026-12-24"]
    path.write_text(APPLIED.replace("timezone: Europe/Berlin", "timezone: Mars/Base"))
    refused = await chimes(api_url, tokens["team-a"], "apply", "-f", str(path))
    assert refused.exit_code != 0 and "calendars.holidays: timezone" in refused.output


APPLIED = """
owner: team-a
calendars:
  holidays: {timezone: Europe/Berlin, dates: ["2026-12-25"]}
jobs:
  - name: nightly
    schedule: {cron: "0 2 * * *", excludeCalendars: [holidays]}
    task: {type: http, url: "http://127.0.0.1:9/"}
"""
