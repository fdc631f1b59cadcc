"""Exclusion calendars through the real API and scheduler: owned per team like jobs, named by jobs,
a slot they exclude recorded as skipped with the calendar named, edits felt within seconds, a
calendar in use not deleted, previews that leave excluded days out."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import httpx
import pytest

from chimes.calendars import CalendarSpec
from chimes.jobs import JobPatch, JobSpec
from chimes.services.jobs import JobService
from chimes.store import db
from chimes.store.calendars import delete_calendar, get_calendar, jobs_using_calendar, lock_calendar, put_calendar
from tests.conftest import TEMPLATE, scratch_database
from tests.helpers import Homes, auth_as, wait_for
from tests.integration.fleet import Fleet
from tests.integration.test_apply import chimes
from tests.integration.test_calendars_fail_closed import POISON_WINDOWS, write_around_the_api
from tests.integration.test_dashboard import signed_in
from tests.integration.test_fences import blocked_on_a_lock, until_blocked_or_done
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


async def test_a_calendar_no_zone_can_represent_is_refused_naming_the_field(client: httpx.AsyncClient) -> None:
    poison = {"timezone": "UTC", "dates": [],
              "windows": [{"start": "0001-01-01T00:00:00+23:59", "end": "0001-01-02T00:00:00Z"}]}
    refused = await client.put("/calendars/poison", json=poison)
    assert refused.status_code == 422 and refused.json()["field"] == "windows.0.start", refused.text
    assert "1970-01-01T00:00:00Z" in refused.json()["message"]
    late = await client.put("/calendars/poison", json={"dates": ["2026-12-25", "9999-12-31"]})
    assert late.status_code == 422 and late.json()["field"] == "dates.1", late.text
    assert (await client.get("/calendars/poison")).status_code == 404


async def test_a_calendars_version_counts_its_own_writes_not_other_teams(
    client: httpx.AsyncClient, tokens: dict[str, str]
) -> None:
    assert (await client.put("/calendars/mine", json={})).json()["version"] == 1
    for _ in range(3):
        await client.put("/calendars/theirs", json={}, headers=auth_as(tokens["team-b"]))
    assert (await client.put("/calendars/mine", json={"dates": ["2026-12-25"]})).json()["version"] == 2
    assert (await client.get("/calendars/mine")).json()["version"] == 2


async def test_next_run_at_is_the_next_slot_that_runs_as_next_runs_says(
    client: httpx.AsyncClient, target: Target
) -> None:
    assert (await client.put("/calendars/days-off", json={})).status_code == 201
    created = await client.post("/jobs", json=job(target, "/daily", {"cron": "0 12 * * *",
                                                                    "excludeCalendars": ["days-off"]}))
    job_id, pending = created.json()["jobId"], datetime.fromisoformat(created.json()["nextRunAt"])
    # The pending slot's day and the next are excluded now: the trigger still waits on the first,
    # which will be recorded as skipped; the job's next run is the day after.
    days = [pending.date(), pending.date() + timedelta(days=1)]
    assert (await client.put("/calendars/days-off", json={"dates": [d.isoformat() for d in days]})).status_code == 200
    answer = (await client.get(f"/jobs/{job_id}", params={"preview": 3})).json()
    assert answer["nextRunAt"] == answer["nextRuns"][0]
    assert datetime.fromisoformat(answer["nextRunAt"]) == pending + timedelta(days=2)
    listed = (await client.get("/jobs")).json()["jobs"]
    assert [j["nextRunAt"] for j in listed if j["jobId"] == job_id] == [answer["nextRunAt"]]
    patched = await client.patch(f"/jobs/{job_id}", json={"tags": ["x"]})
    assert patched.json()["nextRunAt"] == answer["nextRunAt"]
    again = await client.post("/jobs", json=job(target, "/daily-2", {"cron": "0 12 * * *",
                                                                      "excludeCalendars": ["days-off"]}))
    assert again.json()["nextRunAt"] == answer["nextRunAt"]


async def test_a_job_naming_a_calendar_that_cannot_be_read_previews_no_run_and_nothing_answers_500(
    api_url: str, client: httpx.AsyncClient, tokens: dict[str, str], target: Target, pool: asyncpg.Pool
) -> None:
    assert (await client.put("/calendars/poison", json={})).status_code == 201
    created = await client.post("/jobs", json=job(target, "/poisoned", {"cron": "0 12 * * *",
                                                                       "excludeCalendars": ["poison"]}))
    job_id = created.json()["jobId"]
    await write_around_the_api(pool, "team-a", "poison", windows=POISON_WINDOWS)
    answer = await client.get(f"/jobs/{job_id}", params={"preview": 3})
    assert answer.status_code == 200 and answer.json()["nextRuns"] == [] and answer.json()["nextRunAt"] is None
    assert (await client.get("/jobs")).status_code == 200
    unsaved = await client.post("/schedules/preview", json={"schedule": {"cron": "@daily",
                                                                         "excludeCalendars": ["poison"]}})
    assert unsaved.status_code == 422 and unsaved.json()["field"] == "schedule.excludeCalendars", unsaved.text
    assert "'poison' cannot be read" in unsaved.json()["message"]
    for after in ["0001-01-01T00:00:00+23:59", "9999-12-31T23:59:59-23:59"]:
        far = await client.post("/schedules/preview", json={"schedule": {"cron": "@daily"}, "after": after})
        assert far.status_code == 422 and far.json()["field"] == "after", far.text
    shown = await client.get("/calendars/poison")
    assert shown.status_code == 200 and shown.json()["windows"] == POISON_WINDOWS
    assert (await client.get("/calendars")).status_code == 200
    async with signed_in(api_url, tokens["team-a"]) as browser:
        assert (await browser.get(f"/ui/jobs/{job_id}")).status_code == 200
        assert (await browser.get("/ui/jobs")).status_code == 200
    assert (await client.put("/calendars/poison", json={})).status_code == 200  # written again: fixed
    assert len((await client.get(f"/jobs/{job_id}", params={"preview": 3})).json()["nextRuns"]) == 3


async def test_backfill_records_the_slots_a_calendar_excludes_as_skipped_naming_it(
    client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    end = datetime.now(UTC).replace(minute=30, second=0, microsecond=0) - timedelta(hours=1)
    start = end - timedelta(hours=6)  # six slots, at the hours in (start, end]
    frozen = {"start": (start + timedelta(hours=1)).isoformat(), "end": (start + timedelta(hours=3)).isoformat()}
    assert (await client.put("/calendars/freeze", json={"windows": [frozen]})).status_code == 201
    created = await client.post("/jobs", json=job(target, "/hourly", {"cron": "0 * * * *",
                                                                     "excludeCalendars": ["freeze"]}))
    job_id = created.json()["jobId"]
    made = await client.post(f"/jobs/{job_id}/backfill", json={"start": start.isoformat(), "end": end.isoformat()})
    assert made.status_code == 202, made.text
    assert (made.json()["created"], made.json()["existing"]) == (4, 0)
    assert made.json()["skipped"] == 2
    pool = await homes.for_job(job_id)
    runs = await pool.fetch("SELECT scheduled_at, status, reason FROM runs WHERE job_id = $1 ORDER BY scheduled_at",
                            uuid.UUID(job_id))
    assert [(r["status"], r["reason"]) for r in runs] == (
        [("scheduled", "backfill")] + [("skipped", "excluded by calendar freeze (backfill)")] * 2
        + [("scheduled", "backfill")] * 3)
    queued = await pool.fetchval("SELECT count(*) FROM run_queue WHERE job_id = $1", uuid.UUID(job_id))
    assert queued == 4
    again = (await client.post(f"/jobs/{job_id}/backfill", json={"start": start.isoformat(),
                                                                 "end": end.isoformat()})).json()
    assert (again["created"], again["skipped"], again["existing"]) == (0, 0, 6)


@pytest.fixture
async def shard_pool(server_dsn: str, template_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    """A second home database beside the test's catalog (``pool``), as a shard is."""
    async with scratch_database(server_dsn, "chimes_calendar_shard", TEMPLATE) as dsn:
        shard = await db.create_pool(dsn, max_size=4)
        yield shard
        await shard.close()


@pytest.mark.own_shard_map
async def test_on_a_shard_a_calendar_an_edit_names_is_not_deleted_before_the_edit_commits(
    pool: asyncpg.Pool, shard_pool: asyncpg.Pool
) -> None:
    """The edit checks the calendar in the catalog and writes the job on its shard: the calendar stays
    locked until the job is written there, so a delete (which locks it, then looks for jobs naming it
    on every home) waits for the edit and finds the job, instead of deleting a calendar the job names."""
    await put_calendar(pool, "team-a", "freeze", CalendarSpec())
    jobs = JobService(shard_pool, catalog=pool)
    now = datetime.now(UTC)
    made = await jobs.create("team-a", JobSpec.model_validate(
        {"name": "nightly", "schedule": {"cron": "0 2 * * *"}, "task": {"type": "http", "url": "http://127.0.0.1:9/"}}),
        now)
    patch = JobPatch.model_validate({"schedule": {"cron": "0 2 * * *", "excludeCalendars": ["freeze"]}})
    async with shard_pool.acquire() as held, pool.acquire() as deleting:
        # The edit is held on its shard after its calendar check (its trigger is locked here).
        holding = held.transaction()
        await holding.start()
        await held.execute("SELECT 1 FROM triggers WHERE job_id = $1 FOR UPDATE", made.job_id)
        edit = asyncio.create_task(jobs.update(made.job_id, "team-a", patch, now))
        await wait_for(lambda: blocked_on_a_lock(shard_pool), timeout=10, what="the edit to reach its shard's write")
        # A delete of the calendar, as DELETE /calendars/{name} makes it.
        delete = deleting.transaction()
        await delete.start()
        locking = asyncio.create_task(lock_calendar(deleting, "team-a", "freeze"))
        await until_blocked_or_done(pool, locking)
        released = not locking.done()
        if released:  # waiting for the edit, which goes on once its shard lets it
            await holding.rollback()
        assert await locking
        if not await jobs_using_calendar(shard_pool, "team-a", "freeze", 20):
            await delete_calendar(deleting, "team-a", "freeze")
        await delete.commit()
        if not released:
            await holding.rollback()
        await edit
    named = await shard_pool.fetchval("SELECT exclude_calendars FROM jobs WHERE job_id = $1", made.job_id)
    assert named == ["freeze"]
    assert await get_calendar(pool, "team-a", "freeze") is not None, "the job names a calendar that was deleted"
