"""Interval schedules and startAt/endAt bounds through the real API and scheduler (in-process fleet,
real PostgreSQL, real HTTP target): the grid they fire on, catch-up, concurrency, and bad input."""

from __future__ import annotations

import itertools
import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import asyncpg
import httpx
import pytest

from chimes.dashboard import views
from chimes.ids import partition_of
from chimes.scheduler.firing import follow_up, plan_fire
from chimes.slots import jitter_offset
from chimes.store.scheduling import DueTrigger, SchedulerStore
from tests.helpers import Homes, wait_for
from tests.integration.fleet import Fleet
from tests.integration.test_apply import chimes
from tests.integration.test_dashboard import signed_in
from tests.integration.test_semantics import _count, _node_for_catch_up, _outage, _settled, job, runs
from tests.target import Target


def epoch_seconds(moment: datetime) -> float:
    return moment.timestamp()


async def test_an_interval_with_a_phase_fires_on_its_grid_with_jitter(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    created = await client.post("/jobs", json=job(target, "/every", {"every": "2s", "phase": "1s", "jitterSec": 1},
                                                  concurrency="allow"))
    assert created.status_code == 201, created.text
    job_id = created.json()["jobId"]
    offset = jitter_offset(uuid.UUID(job_id), 1)
    first = datetime.fromisoformat(created.json()["nextRunAt"])
    assert (first - offset).microsecond == 0 and int(epoch_seconds(first - offset)) % 2 == 1
    shown = (await client.get(f"/jobs/{job_id}")).json()
    assert shown["schedule"] == {"everySec": 2, "phaseSec": 1, "jitterSec": 1}
    pool = await homes.for_job(job_id)
    await wait_for(lambda: _count(pool, job_id, "succeeded", 3), timeout=20, what="three interval runs")
    assert (await client.patch(f"/jobs/{job_id}", json={"paused": True})).status_code == 200
    history = await runs(pool, job_id)
    # Odd seconds since the epoch, 2 s apart, none missing; each fired no earlier than slot + jitter.
    assert all(int(epoch_seconds(r["scheduled_at"])) % 2 == 1 for r in history)
    assert all(b["scheduled_at"] - a["scheduled_at"] == timedelta(seconds=2) for a, b in itertools.pairwise(history))
    assert all(r["fired_at"] >= r["scheduled_at"] + offset for r in history)


async def test_an_interval_job_skips_a_fire_while_its_run_is_still_active(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    target.delays["/slow-every"] = lambda n: 2.5  # longer than the interval
    created = await client.post("/jobs", json=job(target, "/slow-every", {"everySec": 1}, concurrency="skip"))
    job_id = created.json()["jobId"]
    pool = await homes.for_job(job_id)
    await wait_for(lambda: _count(pool, job_id, "skipped", 2), timeout=20, what="two skipped fires")
    assert (await client.patch(f"/jobs/{job_id}", json={"paused": True})).status_code == 200
    await wait_for(lambda: _settled(pool, job_id), timeout=20, what="the last run to end")
    skipped = [r for r in await runs(pool, job_id) if r["status"] == "skipped"]
    assert all("previous run is still active" in r["reason"] for r in skipped)


async def test_an_interval_job_catches_up_by_its_policy(client: httpx.AsyncClient, target: Target,
                                                       homes: Homes) -> None:
    created = await client.post("/jobs", json=job(target, "/every-catch-up", {"every": "10s"},
                                                  catchUp={"policy": "one"}, concurrency="allow"))
    job_id = created.json()["jobId"]
    pool = await homes.for_job(job_id)
    await _outage(pool, job_id, 60)  # seven 10-second slots missed, the last one just now
    node, task = await _node_for_catch_up(pool)
    try:
        await wait_for(lambda: _catch_up_run(pool, job_id), timeout=20, what="the catch-up run")
    finally:
        node.stop()
        await task
    history = await runs(pool, job_id)
    last = max(i for i, r in enumerate(history) if r["trigger"] == "catchup")
    missed = history[:last + 1]
    assert len(missed) in (7, 8)
    assert all(r["status"] == "skipped" and "caught up by the run of" in r["reason"] for r in missed[:-1])
    assert all(int(epoch_seconds(r["scheduled_at"])) % 10 == 0 for r in missed)


async def _catch_up_run(pool: asyncpg.Pool, job_id: str) -> bool:
    return await pool.fetchval("SELECT count(*) FROM runs WHERE job_id = $1 AND trigger = 'catchup'",
                               uuid.UUID(job_id)) > 0


async def test_start_and_end_bound_the_fires_and_an_ended_job_has_no_next_run(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    start = (datetime.now(UTC) + timedelta(seconds=2)).replace(microsecond=0)
    end = start + timedelta(seconds=3)
    created = await client.post("/jobs", json=job(target, "/bounded", {
        "cron": "* * * * * *", "startAt": start.isoformat(), "endAt": end.isoformat()}, concurrency="allow"))
    assert created.status_code == 201, created.text
    job_id = created.json()["jobId"]
    assert datetime.fromisoformat(created.json()["nextRunAt"]) == start
    pool = await homes.for_job(job_id)
    await wait_for(lambda: _no_next_run(client, job_id), timeout=20, what="the schedule to end")
    await wait_for(lambda: _settled(pool, job_id), timeout=20, what="the last run to end")
    assert [r["scheduled_at"] for r in await runs(pool, job_id)] == [start + timedelta(seconds=s) for s in range(4)]
    shown = (await client.get(f"/jobs/{job_id}")).json()
    assert shown["nextRunAt"] is None and shown["scheduleEnded"] is True
    assert shown["schedule"]["endAt"] == end.isoformat().replace("+00:00", "Z")


async def _no_next_run(client: httpx.AsyncClient, job_id: str) -> bool:
    return (await client.get(f"/jobs/{job_id}")).json()["nextRunAt"] is None


async def test_a_cron_job_changed_to_an_interval_fires_on_the_new_grid(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    created = await client.post("/jobs", json=job(target, "/changed-rule", {"cron": "0 0 1 1 *"}))
    job_id = created.json()["jobId"]
    changed = await client.patch(f"/jobs/{job_id}", json={"schedule": {"every": "1h30m", "phase": "15m"}})
    assert changed.status_code == 200, changed.text
    assert changed.json()["schedule"] == {"everySec": 5400, "phaseSec": 900}
    following = datetime.fromisoformat(changed.json()["nextRunAt"])
    assert (epoch_seconds(following) - 900) % 5400 == 0
    assert timedelta(0) < following - datetime.now(UTC) <= timedelta(minutes=90)


BAD_SCHEDULES = [
    ({"everySec": 0}, "schedule.everySec", "greater than or equal to 1"),
    ({"every": "0s"}, "schedule.everySec", "greater than or equal to 1"),
    ({"every": "ninety minutes"}, "schedule", "invalid duration"),
    ({"every": "1h", "phase": "2h"}, "schedule.phaseSec", "less than everySec"),
    ({"every": "1h", "cron": "* * * * *"}, "schedule", "exactly one"),
    ({"cron": "* * * * *", "startAt": "2030-02-01T00:00:00Z", "endAt": "2030-01-01T00:00:00Z"}, "schedule.endAt",
     "after startAt"),
    ({"everySec": 60, "startAt": "2030-02-01T00:00:00"}, "schedule.startAt", "offset"),
]


@pytest.mark.parametrize(("schedule", "field", "words"), BAD_SCHEDULES, ids=[b[1] + ":" + b[2] for b in BAD_SCHEDULES])
async def test_a_bad_schedule_is_refused_naming_the_field_and_nothing_is_written(
    client: httpx.AsyncClient, target: Target, homes: Homes, schedule: dict, field: str, words: str
) -> None:
    response = await client.post("/jobs", json=job(target, "/bad", schedule))
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["error"] == "invalid_request" and body["field"] == field and words in body["message"]
    assert await homes.total("SELECT count(*) FROM jobs") == 0


PREVIEWED = [
    # Weekly at 02:30 in New York: the spring-forward Sunday (2:30 does not exist) is skipped.
    ({"cron": "30 2 * * 0", "timezone": "America/New_York", "dstGap": "skip", "jitterSec": 600}, 30),
    # Weekly at 01:30 in New York: the fall-back Sunday runs at both 01:30s.
    ({"cron": "30 1 * * 0", "timezone": "America/New_York", "dstFold": "both", "jitterSec": 90}, 60),
    ({"every": "90m", "phase": "15m", "jitterSec": 30}, 20),
]


@pytest.mark.parametrize(("schedule", "count"), PREVIEWED, ids=["dst-gap-skip", "dst-fold-both", "interval"])
async def test_the_api_and_dashboard_previews_are_the_fires_the_scheduler_makes(
    client: httpx.AsyncClient, api_url: str, tokens: dict[str, str], homes: Homes, schedule: dict, count: int
) -> None:
    end = datetime.now(UTC) + timedelta(days=500)
    body = {"name": "previewed", "schedule": schedule | {"endAt": end.isoformat()},
            "task": {"type": "http", "url": "http://127.0.0.1:9/"}}
    job_id = (await client.post("/jobs", json=body)).json()["jobId"]
    shown = (await client.get(f"/jobs/{job_id}", params={"preview": count})).json()
    previewed = [datetime.fromisoformat(t) for t in shown["nextRuns"]]
    fired = await scheduler_fires(await homes.for_job(job_id), job_id, count)
    assert previewed == fired and len(fired) == count
    if "dstGap" in schedule:
        assert not any(t.astimezone(ZoneInfo("America/New_York")).month == 3 and 8 <= t.day <= 14
                       and t.year == 2027 for t in fired)
    if "dstFold" in schedule:  # 01:30 EDT and 01:30 EST, an hour apart
        assert any(b - a == timedelta(hours=1) for a, b in itertools.pairwise(fired))
    async with signed_in(api_url, tokens["team-a"]) as browser:
        page = (await browser.get(f"/ui/jobs/{job_id}")).text
    assert re.findall(r'<li title="([^"]+)">', page) == [views.utc(t) for t in fired[:5]]


async def scheduler_fires(pool: asyncpg.Pool, job_id: str, count: int) -> list[datetime]:
    """The instants the scheduler fires the job at: its trigger as the due scan reads it, then the
    node's own planning of each fire and of the trigger it leaves behind."""
    store = SchedulerStore(pool, "preview-check")
    triggers = await store.scan_due([partition_of(uuid.UUID(job_id))], datetime.now(UTC) + timedelta(days=3660), 10)
    [trigger] = [t for t in triggers if str(t.job_id) == job_id]
    fires: list[datetime] = []
    following: DueTrigger | None = trigger
    while following is not None and len(fires) < count:
        fires.append(following.fire_at)
        following = follow_up(plan_fire(following))
    return fires


async def test_a_schedule_not_saved_yet_is_previewed_and_a_bad_one_refused(client: httpx.AsyncClient) -> None:
    answer = await client.post("/schedules/preview", json={
        "schedule": {"every": "90m", "phase": "15m", "jitterSec": 60}, "n": 3, "after": "2026-01-01T00:00:00Z"})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"fires": ["2026-01-01T00:15:00Z", "2026-01-01T01:45:00Z", "2026-01-01T03:15:00Z"],
                             "jitterSec": 60}
    dst = await client.post("/schedules/preview", json={
        "schedule": {"cron": "30 2 * * *", "timezone": "America/New_York"}, "n": 2, "after": "2026-03-07T12:00:00Z"})
    assert dst.json()["fires"] == ["2026-03-08T07:00:00Z", "2026-03-09T06:30:00Z"]  # shifted out of the gap
    bad = await client.post("/schedules/preview", json={"schedule": {"everySec": 0}})
    assert bad.status_code == 422 and bad.json()["field"] == "schedule.everySec"
    too_many = await client.post("/schedules/preview", json={"schedule": {"cron": "@daily"}, "n": 1000})
    assert too_many.status_code == 422 and too_many.json()["field"] == "n"


async def test_the_cli_makes_and_changes_an_interval_job_and_lists_fires(
    api_url: str, tokens: dict[str, str], client: httpx.AsyncClient
) -> None:
    created = await chimes(api_url, tokens["team-a"], "jobs", "create", "--name", "every-90", "--every", "90m",
                           "--phase", "15m", "--end-at", "2030-01-01T00:00:00Z", "--url", "http://127.0.0.1:9/")
    assert created.exit_code == 0, created.output
    job_id = created.output.split()[2]
    changed = await chimes(api_url, tokens["team-a"], "jobs", "update", job_id, "--phase", "30m")
    assert changed.exit_code == 0, changed.output
    schedule = (await client.get(f"/jobs/{job_id}")).json()["schedule"]
    assert schedule == {"everySec": 5400, "phaseSec": 1800, "endAt": "2030-01-01T00:00:00Z"}
    shown = await chimes(api_url, tokens["team-a"], "jobs", "get", job_id, "--next", "3")
    assert shown.exit_code == 0 and "every 1h30m +30m until 2030-01-01" in shown.output
    assert shown.output.count(":30:00") + shown.output.count(":00:00") >= 3  # the grid: 00:30, 02:00, 03:30 ...
    listed = await chimes(api_url, tokens["team-a"], "cron", "next", "--every", "90m", "--phase", "15m", "-n", "2",
                          "--after", "2026-01-01T00:00:00Z")
    assert listed.exit_code == 0 and listed.output.splitlines()[0].startswith("2026-01-01T00:15:00Z")
    refused = await chimes(api_url, tokens["team-a"], "jobs", "create", "--name", "x", "--every", "0s",
                           "--url", "http://127.0.0.1:9/")
    assert refused.exit_code != 0 and "schedule.everySec" in refused.output


async def test_apply_takes_an_interval_as_a_duration_and_reapplying_changes_nothing(
    api_url: str, tokens: dict[str, str], tmp_path: Path
) -> None:
    path = tmp_path / "jobs.yaml"
    path.write_text("owner: team-a\njobs:\n  - name: every-90\n    schedule: {every: 90m, phase: 15m, "
                    "startAt: '2026-01-01T00:00:00Z'}\n    task: {type: http, url: 'http://127.0.0.1:9/'}\n")
    first = await chimes(api_url, tokens["team-a"], "apply", "-f", str(path))
    assert first.exit_code == 0, first.output
    again = await chimes(api_url, tokens["team-a"], "apply", "-f", str(path))
    assert again.exit_code == 0 and "1 unchanged" in again.output, again.output
    exported = await chimes(api_url, tokens["team-a"], "export")
    assert "everySec: 5400" in exported.output and "phaseSec: 900" in exported.output


async def test_a_run_cap_stops_the_job_after_its_slots_counting_skipped_ones(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    target.delays["/capped"] = lambda n: 1.5  # a fire while it runs is skipped, and counts
    created = await client.post("/jobs", json=job(target, "/capped", {"everySec": 1, "maxRuns": 4},
                                                  concurrency="skip"))
    assert created.status_code == 201, created.text
    job_id = created.json()["jobId"]
    assert (await client.get(f"/jobs/{job_id}")).json()["remainingRuns"] == 4
    pool = await homes.for_job(job_id)
    await wait_for(lambda: _no_next_run(client, job_id), timeout=20, what="the run cap to be reached")
    await wait_for(lambda: _settled(pool, job_id), timeout=20, what="the last run to end")
    history = await runs(pool, job_id)
    assert len(history) == 4 and {r["status"] for r in history} == {"succeeded", "skipped"}
    shown = (await client.get(f"/jobs/{job_id}", params={"preview": 3})).json()
    assert shown["remainingRuns"] == 0 and shown["scheduleEnded"] is True and shown["nextRuns"] == []
    # A higher cap lets it go on from where it is; resuming it does not start the count again.
    more = await client.patch(f"/jobs/{job_id}", json={"schedule": {"everySec": 1, "maxRuns": 6}})
    assert more.json()["remainingRuns"] == 2 and more.json()["nextRunAt"] is not None
    await wait_for(lambda: _no_next_run(client, job_id), timeout=20, what="the new cap to be reached")
    await wait_for(lambda: _settled(pool, job_id), timeout=20, what="the last run to end")
    assert len(await runs(pool, job_id)) == 6


async def test_a_bad_run_cap_is_refused(client: httpx.AsyncClient, target: Target, homes: Homes) -> None:
    response = await client.post("/jobs", json=job(target, "/bad-cap", {"cron": "@daily", "maxRuns": 0}))
    assert response.status_code == 422 and response.json()["field"] == "schedule.maxRuns"
    assert await homes.total("SELECT count(*) FROM jobs") == 0


async def test_while_a_node_of_release_0_1_0_runs_the_schedule_features_it_would_misread_are_refused(
    client: httpx.AsyncClient, homes: Homes
) -> None:
    """A rolling upgrade: a 0.1.0 node reads an interval job as a one-off and ignores bounds, caps and
    calendars, so such jobs wait until no such node is live; other jobs are accepted meanwhile."""
    for home in await homes.homes():  # an old node heartbeats on every home it serves, without a release
        await home.execute("INSERT INTO scheduler_nodes (node_id, hostname, pid) VALUES ('old-node', 'h', 1)")
    task = {"type": "http", "url": "http://127.0.0.1:9/"}
    refused = await client.post("/jobs", json={"name": "sweep", "schedule": {"every": "5m"}, "task": task})
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"] == "upgrade_in_progress" and refused.json()["field"] == "schedule"
    assert "interval schedules need every scheduler node at release 0.2.0" in refused.json()["message"]
    capped = await client.post("/jobs", json={"name": "c", "schedule": {"cron": "0 3 * * *", "maxRuns": 3},
                                              "task": task})
    assert capped.status_code == 409 and "maxRuns" in capped.json()["message"], capped.text
    assert await homes.total("SELECT count(*) FROM jobs") == 0, "nothing written"
    plain = await client.post("/jobs", json={"name": "nightly", "schedule": {"cron": "0 3 * * *"}, "task": task})
    assert plain.status_code == 201, plain.text
    changed = await client.patch(f"/jobs/{plain.json()['jobId']}", json={"schedule": {"every": "1h"}})
    assert changed.status_code == 409, changed.text

    for home in await homes.homes():
        await home.execute("UPDATE scheduler_nodes SET release = '0.2.0' WHERE node_id = 'old-node'")
    assert (await client.post("/jobs", json={"name": "sweep", "schedule": {"every": "5m"}, "task": task})
            ).status_code == 201
