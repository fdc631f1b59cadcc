"""A job's life beyond one run, end to end (real API, scheduler node, worker, PostgreSQL and HTTP
target): concurrency replace, pauses with who and why, pausing after consecutive failures, one-offs that
delete themselves, notifications of started and succeeded runs."""

from __future__ import annotations

import asyncio
import itertools
import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import httpx
import orjson
from click.testing import CliRunner, Result

from chimes.cli import client as cli_client
from chimes.cli.main import cli as main_cli
from chimes.store.owners import OwnerStore
from chimes.store.tokens import create_token
from tests.helpers import Homes, wait_for
from tests.integration.fleet import Fleet
from tests.target import Target

EVERY_TWO_SECONDS = {"cron": "*/2 * * * * *"}


def job(target: Target, path: str, schedule: dict, **extra: object) -> dict:
    return {"name": path.strip("/"), "schedule": schedule, "task": {"type": "http", "url": target.url + path}} | extra


def zulu(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


async def history(pool: asyncpg.Pool, job_id: str) -> list[asyncpg.Record]:
    return await pool.fetch("SELECT * FROM runs WHERE job_id = $1 ORDER BY scheduled_at", uuid.UUID(job_id))


async def count(pool: asyncpg.Pool, job_id: str, status: str) -> int:
    found: int = await pool.fetchval("SELECT count(*) FROM runs WHERE job_id = $1 AND status = $2",
                                     uuid.UUID(job_id), status)
    return found


async def stop(client: httpx.AsyncClient, pool: asyncpg.Pool, job_id: str) -> None:
    """Pause the job and cancel what it still runs, so the test ends with nothing in flight."""
    assert (await client.patch(f"/jobs/{job_id}", json={"paused": True})).status_code == 200
    for run in await history(pool, job_id):
        if run["status"] in ("scheduled", "running"):
            await client.post(f"/runs/{run['run_id']}/cancel")


# --- concurrency replace --------------------------------------------------------------------------

async def test_replace_cancels_the_running_run_and_starts_the_new_slots(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    target.delays["/replaced"] = lambda n: 120  # every call hangs: only a replacement ends a run
    created = await client.post("/jobs", json=job(target, "/replaced", EVERY_TWO_SECONDS, concurrency="replace",
                                                  retryPolicy={"maxAttempts": 1}))
    assert created.status_code == 201, created.text
    job_id = created.json()["jobId"]
    assert (await client.get(f"/jobs/{job_id}")).json()["concurrency"] == "replace"
    pool = await homes.for_job(job_id)
    await wait_for(lambda: len(target.calls_to("/replaced")) >= 3, timeout=20, what="three runs to call the target")
    await wait_for(lambda: _cancelled_and_let_go(pool, job_id, fleet, 2), timeout=10,
                   what="two replaced runs, let go by the worker")
    await stop(client, pool, job_id)
    await wait_for(lambda: not fleet.running(), timeout=10, what="the worker to let go of every run")

    runs = await history(pool, job_id)
    by_slot = {r["scheduled_at"]: r for r in runs}
    # One run per slot, every 2 s, none left out.
    assert all(b["scheduled_at"] - a["scheduled_at"] == timedelta(seconds=2) for a, b in itertools.pairwise(runs))
    replaced = [r for r in runs if r["error"] and "replaced" in r["error"]]
    assert len(replaced) >= 2
    for run in replaced:
        newer = by_slot[run["scheduled_at"] + timedelta(seconds=2)]
        assert run["status"] == "cancelled"
        assert run["error"] == f"replaced by the run of {zulu(newer['scheduled_at'])} (concurrency replace)"
        # The newer run started (unless the test's own cancel came first) once this one had ended.
        assert newer["started_at"] is None or run["finished_at"] <= newer["started_at"]
        shown = (await client.get(f"/runs/{run['run_id']}")).json()
        assert shown["status"] == "cancelled" and shown["error"] == run["error"]
        [attempt] = shown["attempts"]
        assert attempt["status"] == "cancelled" and attempt["error"] == run["error"]
        assert attempt["workerId"] == "test-worker"
    assert not [c for c in target.calls_to("/replaced") if c.run_id not in {str(r["run_id"]) for r in runs}]
    assert await pool.fetchval("SELECT count(*) FROM active_runs WHERE job_id = $1", uuid.UUID(job_id)) == 0


async def _cancelled_and_let_go(pool: asyncpg.Pool, job_id: str, fleet: Fleet, at_least: int) -> bool:
    cancelled = {r["run_id"] for r in await history(pool, job_id) if r["status"] == "cancelled"}
    return len(cancelled) >= at_least and not cancelled & fleet.running()


async def test_replace_cancels_a_run_waiting_for_its_retry(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    target.responders["/flaky"] = lambda n: 503
    created = await client.post("/jobs", json=job(target, "/flaky", EVERY_TWO_SECONDS, concurrency="replace",
                                                  retryPolicy={"maxAttempts": 5, "initialBackoffSec": 3600,
                                                               "maxBackoffSec": 3600}))
    job_id = created.json()["jobId"]
    pool = await homes.for_job(job_id)
    await wait_for(lambda: count(pool, job_id, "cancelled"), timeout=20, what="a retry-waiting run replaced")
    await stop(client, pool, job_id)
    runs = await history(pool, job_id)
    waited = next(r for r in runs if r["status"] == "cancelled" and r["attempt"] == 2)
    assert waited["error"].startswith("replaced by the run of "), waited["error"]
    # Its pending retry went with it: no retry trigger is left to bring it back.
    assert not await pool.fetchval("SELECT count(*) FROM triggers WHERE trigger_id = $1 AND kind = 1",
                                   waited["run_id"])
    shown = (await client.get(f"/runs/{waited['run_id']}")).json()
    assert [a["status"] for a in shown["attempts"]] == ["failed"]  # the attempt that ran, and no other
    assert sum(1 for c in target.calls_to("/flaky") if c.run_id == str(waited["run_id"])) == 1


async def test_an_unknown_concurrency_policy_is_refused_by_name(client: httpx.AsyncClient, target: Target) -> None:
    answer = await client.post("/jobs", json=job(target, "/bad", EVERY_TWO_SECONDS, concurrency="cancel-other"))
    assert answer.status_code == 422
    assert answer.json()["field"] == "concurrency"
    assert (await client.get("/jobs")).json()["jobs"] == []


# --- pauses: who and why, and pausing after consecutive failures -------------------------------

async def test_a_job_pauses_itself_after_consecutive_failed_runs(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    # Run 1 fails (both attempts), run 2 succeeds, runs 3 to 5 fail: the streak of 3 ends at run 5.
    target.responders["/failing"] = lambda n: 200 if n == 3 else 503
    created = await client.post("/jobs", json=job(target, "/failing", {"cron": "* * * * * *"}, pauseAfterFailures=3,
                                                  retryPolicy={"maxAttempts": 2, "initialBackoffSec": 0.1,
                                                               "maxBackoffSec": 0.1}))
    assert created.status_code == 201, created.text
    job_id = created.json()["jobId"]
    pool = await homes.for_job(job_id)

    async def paused() -> dict | None:
        shown = (await client.get(f"/jobs/{job_id}")).json()
        return shown if shown["paused"] else None

    shown = await wait_for(paused, timeout=30, what="the job to pause itself")
    assert shown["pauseAfterFailures"] == 3
    assert shown["pausedBy"] == "chimes"
    assert shown["pauseNote"] == "3 consecutive runs failed (pauseAfterFailures)"
    assert shown["pausedAt"] is not None
    # A slot that was due when the job paused itself fires once, late; none after the pause.
    await wait_for(lambda: _no_schedule_trigger(pool, job_id), timeout=10, what="the slots due at the pause to fire")
    paused_at = datetime.fromisoformat(shown["pausedAt"])
    assert not await pool.fetchval("SELECT count(*) FROM runs WHERE job_id = $1 AND scheduled_at > $2",
                                   uuid.UUID(job_id), paused_at)
    ended = [r for r in await history(pool, job_id) if r["status"] in ("succeeded", "failed")][:5]
    assert [r["status"] for r in ended] == ["failed", "succeeded", "failed", "failed", "failed"]
    assert all(r["attempt"] == 2 for r in ended if r["status"] == "failed")  # final failures, after the retry
    [pause] = (await client.get(f"/jobs/{job_id}/pauses")).json()["pauses"]
    assert pause["pausedBy"] == "chimes" and pause["note"] == shown["pauseNote"]
    assert pause["pausedAt"] == shown["pausedAt"] and pause["resumedAt"] is None
    # Resuming clears the pause, records who resumed, and starts a new streak: the job, still failing,
    # pauses again after three more failures, not after the first.
    resumed = (await client.patch(f"/jobs/{job_id}", json={"paused": False, "catchUp": {"policy": "none"}})).json()
    assert resumed["paused"] is False and resumed["pausedBy"] is None and resumed["pauseNote"] is None
    [pause] = (await client.get(f"/jobs/{job_id}/pauses")).json()["pauses"]
    assert pause["resumedBy"] == "team-a" and pause["resumedAt"] is not None
    resumed_at = datetime.fromisoformat(pause["resumedAt"])
    again = await wait_for(paused, timeout=30, what="the job to pause itself again")
    failed_since = await pool.fetchval("SELECT count(*) FROM runs WHERE job_id = $1 AND status = 'failed' "
                                       "AND fired_at >= $2", uuid.UUID(job_id), resumed_at)
    assert failed_since == 3 and again["pausedBy"] == "chimes"
    await stop(client, pool, job_id)


async def _no_schedule_trigger(pool: asyncpg.Pool, job_id: str) -> bool:
    return not await pool.fetchval("SELECT count(*) FROM triggers WHERE job_id = $1 AND kind = 0", uuid.UUID(job_id))


async def test_a_pause_records_the_tokens_name_and_the_note(
    client: httpx.AsyncClient, api_url: str, pool: asyncpg.Pool, target: Target
) -> None:
    async with pool.acquire() as conn:
        bot = await create_token(conn, "team-a", name="ops-bot")
    job_id = (await client.post("/jobs", json=job(target, "/noted", {"cron": "0 3 * * *"}))).json()["jobId"]
    result = await cli(["pause", job_id, "--note", "incident 123"], api_url, bot)
    assert result.exit_code == 0, result.output
    assert "paused by ops-bot: incident 123" in result.output
    shown = (await client.get(f"/jobs/{job_id}")).json()
    assert (shown["paused"], shown["pausedBy"], shown["pauseNote"]) == (True, "ops-bot", "incident 123")
    detail = await cli(["get", job_id], api_url, bot)
    assert "by ops-bot: incident 123" in detail.output, detail.output
    # Pausing a paused job again keeps who paused it first, and why.
    again = await client.patch(f"/jobs/{job_id}", json={"paused": True, "pauseNote": "something else"})
    assert again.json()["pausedBy"] == "ops-bot" and again.json()["pauseNote"] == "incident 123"
    await client.patch(f"/jobs/{job_id}", json={"paused": False})
    history_lines = await cli(["pauses", job_id], api_url, bot)
    assert "by ops-bot: incident 123; resumed" in history_lines.output and "by team-a" in history_lines.output


async def test_a_pause_note_needs_a_pause_and_a_bad_streak_is_refused(
    client: httpx.AsyncClient, target: Target
) -> None:
    job_id = (await client.post("/jobs", json=job(target, "/refused", {"cron": "0 3 * * *"}))).json()["jobId"]
    before = (await client.get(f"/jobs/{job_id}")).json()
    answer = await client.patch(f"/jobs/{job_id}", json={"pauseNote": "why not", "name": "renamed"})
    assert answer.status_code == 422 and answer.json()["field"] == "pauseNote", answer.text
    answer = await client.patch(f"/jobs/{job_id}", json={"pauseAfterFailures": 0})
    assert answer.status_code == 422 and answer.json()["field"] == "pauseAfterFailures", answer.text
    created = await client.post("/jobs", json=job(target, "/refused", {"cron": "0 3 * * *"}, pauseAfterFailures="x"))
    assert created.status_code == 422 and created.json()["field"] == "pauseAfterFailures"
    assert (await client.get(f"/jobs/{job_id}")).json() == before
    assert (await client.get(f"/jobs/{job_id}/pauses")).json() == {"pauses": []}


async def cli(args: list[str], url: str, token: str) -> Result:
    env = {"CHIMES_TOKEN": token, "CHIMES_API_URL": url, "COLUMNS": "200"}
    return await asyncio.to_thread(CliRunner().invoke, cli_client.jobs, args, env=env)


# --- one-offs that delete themselves ---------------------------------------------------------------

def soon(seconds: float = 0.5) -> dict[str, str]:
    return {"at": (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()}


async def gone(client: httpx.AsyncClient, job_id: str) -> bool:
    answer = await client.get(f"/jobs/{job_id}")
    return answer.status_code == 404 and answer.json()["error"] == "job_deleted"


async def test_a_one_off_deletes_itself_after_its_run_and_frees_its_quota(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, pool: asyncpg.Pool, homes: Homes
) -> None:
    await OwnerStore(pool).set("team-a", job_quota=1)
    created = await client.post("/jobs", json=job(target, "/once", soon(), deleteAfterCompletion=True))
    assert created.status_code == 201, created.text
    job_id = created.json()["jobId"]
    assert (await client.get(f"/jobs/{job_id}")).json()["deleteAfterCompletion"] is True
    refused = await client.post("/jobs", json=job(target, "/twice", soon(60)))
    assert refused.status_code == 429, refused.text  # the one-off still counts while it has not run
    await wait_for(lambda: gone(client, job_id), timeout=20, what="the one-off to delete itself")
    # Its run stays readable, by id and in the job's run list.
    listed = (await client.get(f"/jobs/{job_id}/runs")).json()
    [run] = listed["runs"]
    assert run["status"] == "succeeded" and listed["jobDeleted"] is True
    assert (await client.get(f"/runs/{run['runId']}")).json()["status"] == "succeeded"
    job_home = await homes.for_job(job_id)
    assert not await job_home.fetchval("SELECT count(*) FROM triggers WHERE job_id = $1", uuid.UUID(job_id))
    # The finished one-off no longer counts against the quota of 1.
    assert (await client.post("/jobs", json=job(target, "/twice", soon(60)))).status_code == 201


async def test_a_one_off_that_failed_for_good_deletes_itself_but_a_manual_run_does_not(
    fleet: Fleet, client: httpx.AsyncClient, target: Target
) -> None:
    target.responders["/broken"] = lambda n: 500
    job_id = (await client.post("/jobs", json=job(target, "/broken", soon(30), deleteAfterCompletion=True,
                                                  retryPolicy={"maxAttempts": 2, "initialBackoffSec": 0.1,
                                                               "maxBackoffSec": 0.1}))).json()["jobId"]
    manual = (await client.post(f"/jobs/{job_id}/runs")).json()["runId"]
    await wait_for(lambda: _status_is(client, manual, "failed"), timeout=20, what="the manual run to fail")
    assert (await client.get(f"/jobs/{job_id}")).status_code == 200  # a manual run does not end the one-off
    moved = await client.patch(f"/jobs/{job_id}", json={"schedule": soon()})
    assert moved.status_code == 200, moved.text
    await wait_for(lambda: gone(client, job_id), timeout=20, what="the failed one-off to delete itself")
    runs = (await client.get(f"/jobs/{job_id}/runs")).json()["runs"]
    scheduled = [r for r in runs if r["trigger"] == "schedule"]
    assert [(r["status"], r["attempt"]) for r in scheduled] == [("failed", 2)]  # after its retry


async def test_a_one_off_whose_slot_is_skipped_deletes_itself(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    """A one-off that missed its time with catchUp none is recorded as skipped: that is its end, and
    the job goes, its skipped run still listed under its id."""
    created = await client.post("/jobs", json=job(target, "/missed", soon(60), deleteAfterCompletion=True,
                                                  catchUp={"policy": "none"}))
    job_id = created.json()["jobId"]
    home = await homes.for_job(job_id)
    await home.execute("UPDATE triggers SET fire_at = now() - interval '10 minutes' WHERE job_id = $1",
                       uuid.UUID(job_id))  # the scheduler was down at its time
    await wait_for(lambda: gone(client, job_id), timeout=20, what="the skipped one-off to delete itself")
    listed = (await client.get(f"/jobs/{job_id}/runs")).json()
    [run] = listed["runs"]
    assert (run["status"], listed["jobDeleted"]) == ("skipped", True)
    assert not await home.fetchval("SELECT count(*) FROM job_pauses WHERE job_id = $1", uuid.UUID(job_id))


async def _status_is(client: httpx.AsyncClient, run_id: str, status: str) -> bool:
    return (await client.get(f"/runs/{run_id}")).json()["status"] == status


async def test_only_a_one_off_can_delete_itself(client: httpx.AsyncClient, target: Target) -> None:
    answer = await client.post("/jobs", json=job(target, "/cron", {"cron": "0 3 * * *"}, deleteAfterCompletion=True))
    assert answer.status_code == 422 and answer.json()["field"] == "deleteAfterCompletion", answer.text
    at = await client.post("/jobs", json=job(target, "/at", soon(3600), deleteAfterCompletion=True))
    job_id = at.json()["jobId"]
    before = (await client.get(f"/jobs/{job_id}")).json()
    answer = await client.patch(f"/jobs/{job_id}", json={"schedule": {"cron": "0 3 * * *"}})
    assert answer.status_code == 422 and answer.json()["field"] == "deleteAfterCompletion", answer.text
    assert (await client.get(f"/jobs/{job_id}")).json() == before
    assert len((await client.get("/jobs")).json()["jobs"]) == 1


async def test_the_cli_creates_jobs_with_the_lifecycle_options(
    client: httpx.AsyncClient, api_url: str, tokens: dict[str, str], target: Target
) -> None:
    at = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    one_off = await cli(["create", "--name", "once", "--at", at, "--url", target.url + "/x",
                         "--delete-after-completion", "--concurrency", "replace", "--notify-on", "started",
                         "--notify-on", "succeeded"], api_url, tokens["team-a"])
    assert one_off.exit_code == 0, one_off.output
    recurring = await cli(["create", "--name", "nightly", "--cron", "0 3 * * *", "--url", target.url + "/y",
                           "--pause-after-failures", "3"], api_url, tokens["team-a"])
    assert recurring.exit_code == 0, recurring.output
    shown = {j["name"]: j for j in (await client.get("/jobs")).json()["jobs"]}
    assert shown["once"]["deleteAfterCompletion"] is True and shown["once"]["concurrency"] == "replace"
    assert shown["once"]["notifyOn"] == ["started", "succeeded"]
    assert shown["nightly"]["pauseAfterFailures"] == 3 and "deleteAfterCompletion" not in shown["nightly"]


# --- notifyOn ----------------------------------------------------------------------------------------

async def test_notify_on_started_and_succeeded_through_the_outbox(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    target.responders["/broken"] = lambda n: 500
    burst = [(await client.post("/jobs", json=job(target, "/fine", soon(), name=f"fine-{i}", concurrency="allow",
                                                  notifyOn=["started", "succeeded"],
                                                  notifyUrl=target.url + "/alerts"))).json()["jobId"]
             for i in range(10)]
    # Told of successes only: its failure is not notified.
    quiet = (await client.post("/jobs", json=job(target, "/broken", soon(), notifyOn=["succeeded"],
                                                 retryPolicy={"maxAttempts": 1},
                                                 notifyUrl=target.url + "/alerts"))).json()["jobId"]
    await wait_for(lambda: len(target.calls_to("/alerts")) >= 20, timeout=30, what="20 notifications")
    await wait_for(lambda: _run_ended(homes, quiet), timeout=20, what="the quiet job's run to fail")
    await wait_for(lambda: _all_sent(homes), timeout=10, what="the outbox to be sent")
    told = [orjson.loads(c.body) for c in target.calls_to("/alerts")]
    assert sorted((n["jobId"], n["kind"]) for n in told) == sorted(
        (j, kind) for j in burst for kind in ("run_started", "run_succeeded"))
    for n in told:
        assert n["status"] == ("running" if n["kind"] == "run_started" else "succeeded"), n
        assert n["runId"] and n["attempt"] == 1 and n["startedAt"] is not None
    shown = (await client.get(f"/jobs/{burst[0]}")).json()
    assert shown["notifyOn"] == ["started", "succeeded"]
    listed = (await client.get("/notifications")).json()["notifications"]
    assert {n["kind"] for n in listed} == {"run_started", "run_succeeded"}


async def _run_ended(homes: Homes, job_id: str) -> bool:
    status = await homes.fetchval(job_id, "SELECT status FROM runs WHERE job_id = $1", uuid.UUID(job_id))
    return status == "failed"


async def _all_sent(homes: Homes) -> bool:
    return await homes.total("SELECT count(*) FROM notifications WHERE sent_at IS NULL") == 0


async def test_notify_on_defaults_to_failures_and_refuses_unknown_events(
    client: httpx.AsyncClient, target: Target
) -> None:
    job_id = (await client.post("/jobs", json=job(target, "/x", {"cron": "0 3 * * *"}))).json()["jobId"]
    assert "notifyOn" not in (await client.get(f"/jobs/{job_id}")).json()  # the default: failures only
    for bad in (["finished"], ["failed", "failed"], "failed"):
        answer = await client.post("/jobs", json=job(target, "/y", {"cron": "0 3 * * *"}, notifyOn=bad))
        assert answer.status_code == 422 and answer.json()["field"].startswith("notifyOn"), answer.text
    assert len((await client.get("/jobs")).json()["jobs"]) == 1


# --- the dashboard's job page ---------------------------------------------------------------------

async def test_the_dashboard_pauses_with_its_user_and_shows_who_and_the_lifecycle_settings(
    client: httpx.AsyncClient, api_url: str, pool: asyncpg.Pool, target: Target
) -> None:
    async with pool.acquire() as conn:
        named = await create_token(conn, "team-a", name="night-shift")
    job_id = (await client.post("/jobs", json=job(target, "/shown", {"cron": "0 3 * * *"}, concurrency="replace",
                                                  pauseAfterFailures=5, notifyOn=["failed", "succeeded"],
                                                  notifyUrl=target.url + "/alerts"))).json()["jobId"]
    async with httpx.AsyncClient(base_url=api_url, timeout=30) as browser:
        signed = await browser.post("/ui/login", data={"token": named, "next": "/ui/jobs"})
        assert signed.status_code == 303, signed.text
        page = (await browser.get(f"/ui/jobs/{job_id}")).text
        assert "replace" in page and "5 consecutive failed runs" in page and "failed, succeeded" in page
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
        assert csrf is not None
        assert re.search(r'action="/ui/jobs/[0-9a-f-]+/pause"[^>]*>\s*<input type="hidden" name="csrf"[^>]*>\s*'
                         r'<input type="text" name="note"', page), "the Pause button has a field for the note"
        paused = await browser.post(f"/ui/jobs/{job_id}/pause", data={"csrf": csrf.group(1), "note": "db upgrade"})
        assert paused.status_code == 303, paused.text
        page = (await browser.get(f"/ui/jobs/{job_id}")).text
    assert "by <strong>night-shift</strong>: db upgrade" in page
    shown = (await client.get(f"/jobs/{job_id}")).json()
    assert (shown["pausedBy"], shown["pauseNote"]) == ("night-shift", "db upgrade")


# --- chimes apply -----------------------------------------------------------------------------------

LIFECYCLE_JOBS = """
owner: team-a
jobs:
  - name: latest-wins
    schedule: {cron: "*/5 * * * *"}
    task: {type: http, url: "http://127.0.0.1:9/sync"}
    concurrency: replace
    pauseAfterFailures: 3
    notifyOn: [failed, succeeded]
    notifyUrl: http://127.0.0.1:9/alerts
  - name: migrate-once
    schedule: {at: "2031-01-01T00:00:00Z"}
    task: {type: http, url: "http://127.0.0.1:9/migrate"}
    deleteAfterCompletion: true
"""


async def test_a_job_file_with_the_lifecycle_fields_applies_once(
    client: httpx.AsyncClient, api_url: str, tokens: dict[str, str], tmp_path: Path
) -> None:
    path = tmp_path / "jobs.yaml"
    path.write_text(LIFECYCLE_JOBS)
    env = {"CHIMES_TOKEN": tokens["team-a"], "CHIMES_API_URL": api_url, "COLUMNS": "200"}

    async def apply() -> Result:
        return await asyncio.to_thread(CliRunner().invoke, main_cli, ["apply", "-f", str(path)], env=env)

    first = await apply()
    assert "applied: 2 created, 0 updated, 0 deleted, 0 unchanged" in first.output, first.output
    again = await apply()
    assert "applied: 0 created, 0 updated, 0 deleted, 2 unchanged" in again.output, again.output
    shown = {j["name"]: j for j in (await client.get("/jobs")).json()["jobs"]}
    assert shown["latest-wins"]["concurrency"] == "replace" and shown["latest-wins"]["pauseAfterFailures"] == 3
    assert shown["latest-wins"]["notifyOn"] == ["failed", "succeeded"]
    assert shown["migrate-once"]["deleteAfterCompletion"] is True
    path.write_text(LIFECYCLE_JOBS.replace("pauseAfterFailures: 3", "pauseAfterFailures: 4"))
    changed = await apply()
    assert "pauseAfterFailures: 3 -> 4" in changed.output, changed.output
