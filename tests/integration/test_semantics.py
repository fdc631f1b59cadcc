"""Scheduling semantics end to end (in-process fleet, real PostgreSQL, real HTTP target):
concurrency policies, catch-up after downtime and pause, a record for every slot, jitter, DST policy."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx
import pytest

from chimes.scheduler.node import SchedulerConfig, SchedulerNode
from chimes.slots import jitter_offset
from tests.helpers import Homes, wait_for
from tests.integration.fleet import FAST_SCHEDULER, Fleet
from tests.target import Target


def job(target: Target, path: str, schedule: dict, **extra: object) -> dict:
    return {"name": path.strip("/"), "schedule": schedule, "task": {"type": "http", "url": target.url + path}} | extra


async def runs(pool: asyncpg.Pool, job_id: str) -> list[asyncpg.Record]:
    return await pool.fetch("SELECT * FROM runs WHERE job_id = $1 ORDER BY scheduled_at", uuid.UUID(job_id))


async def test_skip_never_overlaps_and_records_skipped_fires(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    target.delays["/slow"] = lambda n: 3.0  # longer than the 1 s interval
    created = await client.post("/jobs", json=job(target, "/slow", {"cron": "* * * * * *"}, concurrency="skip"))
    job_id = created.json()["jobId"]
    pool = await homes.for_job(job_id)  # the job's database
    await wait_for(lambda: _count(pool, job_id, "succeeded", 2), timeout=20, what="two finished runs")
    assert (await client.patch(f"/jobs/{job_id}", json={"paused": True})).status_code == 200
    await wait_for(lambda: _settled(pool, job_id), timeout=20, what="the last run to end")
    history = await runs(pool, job_id)
    ran = [r for r in history if r["status"] == "succeeded"]
    skipped = [r for r in history if r["status"] == "skipped"]
    assert len(skipped) >= 2
    assert all("previous run is still active" in r["reason"] for r in skipped)
    # Never two at once: each run started after the previous one finished.
    ran.sort(key=lambda r: r["started_at"])
    assert all(a["finished_at"] <= b["started_at"] for a, b in itertools.pairwise(ran))
    # Every slot between the first and the last has a record: ran or skipped, nothing silent.
    slots = [r["scheduled_at"] for r in history]
    assert all(b - a == timedelta(seconds=1) for a, b in itertools.pairwise(slots))
    listed = (await client.get(f"/jobs/{job_id}/runs", params={"status": "skipped"})).json()["runs"]
    assert {r["runId"] for r in listed} == {str(r["run_id"]) for r in skipped}
    assert all(r["reason"] for r in listed)


async def _count(pool: asyncpg.Pool, job_id: str, status: str, at_least: int) -> bool:
    found = await pool.fetchval("SELECT count(*) FROM runs WHERE job_id = $1 AND status = $2", uuid.UUID(job_id),
                                status)
    return found >= at_least


async def _settled(pool: asyncpg.Pool, job_id: str) -> bool:
    return not await pool.fetchval(
        "SELECT count(*) FROM runs WHERE job_id = $1 AND status IN ('scheduled', 'running')", uuid.UUID(job_id))


async def test_queue_runs_strictly_one_after_another(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    target.delays["/queued"] = lambda n: 2.5
    created = await client.post("/jobs", json=job(target, "/queued", {"cron": "* * * * * *"}, concurrency="queue",
                                                  queueLimit=3))
    job_id = created.json()["jobId"]
    pool = await homes.for_job(job_id)  # the job's database
    await wait_for(lambda: _count(pool, job_id, "succeeded", 3), timeout=30, what="three queued runs")
    await wait_for(lambda: _count(pool, job_id, "skipped", 1), timeout=30, what="a fire past the queue limit")
    assert (await client.patch(f"/jobs/{job_id}", json={"paused": True})).status_code == 200
    await wait_for(lambda: _settled(pool, job_id), timeout=30, what="the queue to drain")
    history = await runs(pool, job_id)
    ran = sorted((r for r in history if r["status"] == "succeeded"), key=lambda r: r["started_at"])
    assert all(a["finished_at"] <= b["started_at"] for a, b in itertools.pairwise(ran))
    # Runs start in the order of their slots.
    assert [r["scheduled_at"] for r in ran] == sorted(r["scheduled_at"] for r in ran)
    # Past the limit of 3 waiting runs, fires are recorded as skipped, with the reason.
    skipped = [r for r in history if r["status"] == "skipped"]
    assert skipped and all("queueLimit" in r["reason"] for r in skipped)
    assert await pool.fetchval("SELECT count(*) FROM active_runs") == 0


async def test_allow_overlaps(fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes) -> None:
    target.delays["/overlap"] = lambda n: 2.5
    created = await client.post("/jobs", json=job(target, "/overlap", {"cron": "* * * * * *"}, concurrency="allow"))
    job_id = created.json()["jobId"]
    pool = await homes.for_job(job_id)  # the job's database
    await wait_for(lambda: _running_at_once(pool, job_id, 2), timeout=20, what="two runs at once")
    # No policy reads the runs of an allow job, so none is tracked as active (fire_triggers).
    assert await pool.fetchval("SELECT count(*) FROM active_runs WHERE job_id = $1", uuid.UUID(job_id)) == 0
    await client.patch(f"/jobs/{job_id}", json={"paused": True})


async def test_a_job_changed_from_allow_to_skip_waits_for_the_runs_allow_started(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    target.delays["/changed"] = lambda n: 4.0
    created = await client.post("/jobs", json=job(target, "/changed", {"cron": "* * * * * *"}, concurrency="allow"))
    job_id = created.json()["jobId"]
    pool = await homes.for_job(job_id)  # the job's database
    await wait_for(lambda: _running_at_once(pool, job_id, 2), timeout=20, what="two runs at once")
    assert (await client.patch(f"/jobs/{job_id}", json={"concurrency": "skip"})).status_code == 200
    changed_at = await pool.fetchval("SELECT now()")
    await wait_for(lambda: _skipped_after(pool, job_id, changed_at), timeout=20, what="a fire skipped after the change")
    await wait_for(lambda: _count_fired_after(pool, job_id, changed_at, "succeeded"), timeout=30,
                   what="a run admitted by the skip policy")
    assert (await client.patch(f"/jobs/{job_id}", json={"paused": True})).status_code == 200
    await wait_for(lambda: _settled(pool, job_id), timeout=30, what="the last run to end")
    history = await runs(pool, job_id)
    ran = [r for r in history if r["started_at"] is not None]
    for run in (r for r in ran if r["fired_at"] > changed_at):
        overlapping = [other["scheduled_at"] for other in ran if other["run_id"] != run["run_id"]
                       and other["started_at"] <= run["started_at"] < other["finished_at"]]
        assert not overlapping, f"run of {run['scheduled_at']} started while runs of {overlapping} ran"


async def _skipped_after(pool: asyncpg.Pool, job_id: str, after: datetime) -> bool:
    return await pool.fetchval("SELECT count(*) FROM runs WHERE job_id = $1 AND status = 'skipped' "
                               "AND fired_at > $2", uuid.UUID(job_id), after) > 0


async def _count_fired_after(pool: asyncpg.Pool, job_id: str, after: datetime, status: str) -> bool:
    return await pool.fetchval("SELECT count(*) FROM runs WHERE job_id = $1 AND status = $2 AND fired_at > $3",
                               uuid.UUID(job_id), status, after) > 0


async def _running_at_once(pool: asyncpg.Pool, job_id: str, count: int) -> bool:
    return await pool.fetchval("SELECT count(*) FROM runs WHERE job_id = $1 AND status = 'running'",
                               uuid.UUID(job_id)) >= count


async def _outage(pool: asyncpg.Pool, job_id: str, seconds: int) -> None:
    """The scheduler was down: the job's trigger (every 10 s) is left `seconds` behind, on its grid."""
    await pool.execute("UPDATE triggers SET fire_at = to_timestamp(floor(extract(epoch FROM now()) / 10) * 10 - $2) "
                       "WHERE job_id = $1", uuid.UUID(job_id), seconds)


async def _node_for_catch_up(pool: asyncpg.Pool) -> tuple[SchedulerNode, asyncio.Task[None]]:
    config = SchedulerConfig(lease=FAST_SCHEDULER.lease, lookahead_sec=3, scan_every_sec=0.3, missed_after_sec=5)
    node = SchedulerNode(pool, config, node_id="catch-up-node")
    return node, asyncio.create_task(node.run())


async def _catch_up_records(homes: Homes, client: httpx.AsyncClient, target: Target, policy: dict,
                            path: str, concurrency: str = "allow", **extra: object) -> list[asyncpg.Record]:
    created = await client.post("/jobs", json=job(target, path, {"cron": "*/10 * * * * *"}, catchUp=policy,
                                                  concurrency=concurrency, **extra))
    job_id = created.json()["jobId"]
    pool = await homes.for_job(job_id)  # the job's database
    await _outage(pool, job_id, 60)  # seven 10-second slots missed, the last one just now
    node, task = await _node_for_catch_up(pool)
    try:
        await wait_for(lambda: _has_runs(pool, job_id, 7), timeout=20, what="the missed slots to be accounted for")
    finally:
        node.stop()
        await task
    return await runs(pool, job_id)  # oldest first: the seven missed slots, then any fired since


def _through_last_catch_up(history: list[asyncpg.Record]) -> list[asyncpg.Record]:
    """The slots the catch-up accounted for: up to its last catch-up run (on-time fires may follow)."""
    last = max(i for i, r in enumerate(history) if r["trigger"] == "catchup")
    return history[:last + 1]


async def _has_runs(pool: asyncpg.Pool, job_id: str, count: int) -> bool:
    return await pool.fetchval("SELECT count(*) FROM runs WHERE job_id = $1", uuid.UUID(job_id)) >= count


async def test_catch_up_one_runs_once_and_records_every_missed_slot(
    client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    history = await _catch_up_records(homes, client, target, {"policy": "one"}, "/one")
    missed = _through_last_catch_up(history)
    assert len(missed) in (7, 8)  # 8 when a 10-second boundary passed before the node fired
    assert [r["trigger"] for r in missed] == ["schedule"] * (len(missed) - 1) + ["catchup"]
    assert all(r["status"] == "skipped" for r in missed[:-1])
    assert all("caught up by the run of" in r["reason"] for r in missed[:-1])
    assert f"one catch-up run for {len(missed)} missed fires" in missed[-1]["reason"]
    assert all(b["scheduled_at"] - a["scheduled_at"] == timedelta(seconds=10)
               for a, b in itertools.pairwise(missed))


async def test_catch_up_all_runs_newest_up_to_max(client: httpx.AsyncClient, target: Target,
                                                 homes: Homes) -> None:
    history = await _catch_up_records(homes, client, target, {"policy": "all", "maxRuns": 3}, "/all")
    missed = _through_last_catch_up(history)
    assert len(missed) in (7, 8)  # 8 when a 10-second boundary passed before the node fired
    assert [r["trigger"] for r in missed] == ["schedule"] * (len(missed) - 3) + ["catchup"] * 3
    assert all(r["status"] == "skipped" and "maxRuns" in r["reason"] for r in missed[:-3])
    assert all(r["status"] != "skipped" for r in missed[-3:])


@pytest.mark.parametrize("concurrency", ["skip", "queue"])
async def test_several_runs_of_one_catch_up_are_decided_oldest_first_as_if_fired_one_by_one(
    concurrency: str, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    """skip: the oldest runs and the newer find it active; queue (one may wait): the oldest runs, the
    next waits for it, the newest finds one waiting. No reason names a run that was not there."""
    history = await _catch_up_records(homes, client, target, {"policy": "all", "maxRuns": 3}, f"/{concurrency}",
                                      concurrency, queueLimit=1)
    caught_up = [r for r in _through_last_catch_up(history) if r["trigger"] == "catchup"]
    assert len(caught_up) == 3
    oldest, middle, newest = caught_up
    assert oldest["status"] == "scheduled" and oldest["reason"] == "missed; run late by catch-up"
    if concurrency == "skip":
        assert [r["status"] for r in (middle, newest)] == ["skipped"] * 2
        assert all("the previous run is still active" in r["reason"] for r in (middle, newest))
    else:
        assert middle["status"] == "scheduled" and "waiting for the active run" in middle["reason"]
        assert newest["status"] == "skipped" and "1 runs already waiting (queueLimit)" in newest["reason"]


async def test_catch_up_none_skips_every_missed_slot(client: httpx.AsyncClient, target: Target,
                                                    homes: Homes) -> None:
    history = await _catch_up_records(homes, client, target, {"policy": "none"}, "/none")
    assert [r["status"] for r in history[:7]] == ["skipped"] * 7
    assert all("catch-up policy: none" in r["reason"] for r in history[:7])


async def test_catch_up_window_limits_what_runs(client: httpx.AsyncClient, target: Target,
                                               homes: Homes) -> None:
    history = await _catch_up_records(homes, client, target, {"policy": "all", "maxRuns": 10, "windowSec": 25},
                                      "/window")
    missed = _through_last_catch_up(history)
    old = [r for r in missed if "older than the catch-up window" in (r["reason"] or "")]
    assert 3 <= len(old) <= 5 and all(r["status"] == "skipped" for r in old)
    assert all(r["trigger"] == "catchup" for r in missed[len(old):])


async def test_jitter_delays_fire_but_keeps_the_nominal_slot(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    created = await client.post("/jobs", json=job(target, "/jitter", {"cron": "*/2 * * * * *", "jitterSec": 1}))
    job_id = created.json()["jobId"]
    pool = await homes.for_job(job_id)  # the job's database
    offset = jitter_offset(uuid.UUID(job_id), 1)
    assert datetime.fromisoformat(created.json()["nextRunAt"]).microsecond == offset.microseconds
    await wait_for(lambda: _count(pool, job_id, "succeeded", 2), timeout=20, what="two jittered runs")
    await client.patch(f"/jobs/{job_id}", json={"paused": True})
    for run in await runs(pool, job_id):
        assert run["scheduled_at"].microsecond == 0 and run["scheduled_at"].second % 2 == 0
        assert run["fired_at"] >= run["scheduled_at"] + offset


async def test_resume_after_pause_accounts_for_paused_slots(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    created = await client.post("/jobs", json=job(target, "/paused", {"cron": "*/10 * * * * *"},
                                                  catchUp={"policy": "none"}))
    job_id = created.json()["jobId"]
    pool = await homes.for_job(job_id)  # the job's database
    assert (await client.patch(f"/jobs/{job_id}", json={"paused": True})).status_code == 200
    # Paused two minutes ago, as far as the schedule is concerned.
    await pool.execute("UPDATE jobs SET paused_at = now() - interval '2 minutes' WHERE job_id = $1", uuid.UUID(job_id))
    resumed = (await client.patch(f"/jobs/{job_id}", json={"paused": False})).json()
    assert datetime.fromisoformat(resumed["nextRunAt"]) < datetime.now(UTC)  # the first paused slot
    await wait_for(lambda: _count(pool, job_id, "skipped", 11), timeout=20, what="the paused slots' records")
    skipped = [r for r in await runs(pool, job_id) if r["status"] == "skipped"]
    assert all(r["reason"].startswith("paused") for r in skipped)


async def test_backfill_creates_past_runs_once(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    created = await client.post("/jobs", json=job(target, "/backfill", {"cron": "0 * * * *"}, concurrency="allow"))
    job_id = created.json()["jobId"]
    pool = await homes.for_job(job_id)  # the job's database
    end = datetime.now(UTC).replace(minute=30, second=0, microsecond=0) - timedelta(hours=1)
    body = {"start": (end - timedelta(hours=5)).isoformat(), "end": end.isoformat()}
    first = await client.post(f"/jobs/{job_id}/backfill", json=body)
    assert first.status_code == 202, first.text
    assert first.json()["created"] == 5 and first.json()["existing"] == 0
    again = (await client.post(f"/jobs/{job_id}/backfill", json=body)).json()
    assert again["created"] == 0 and again["existing"] == 5  # deduplicated by run id
    await wait_for(lambda: _count(pool, job_id, "succeeded", 5), timeout=20, what="the backfilled runs")
    history = await runs(pool, job_id)
    assert all(r["trigger"] == "catchup" and r["reason"] == "backfill" for r in history)
    assert [r["scheduled_at"].minute for r in history] == [0] * 5
    assert len(target.calls_to("/backfill")) == 5


async def test_backfill_refuses_bad_ranges(client: httpx.AsyncClient, target: Target, homes: Homes) -> None:
    cron_job = (await client.post("/jobs", json=job(target, "/b", {"cron": "* * * * *"}))).json()["jobId"]
    once = (await client.post("/jobs", json=job(target, "/o", {"at": "2030-01-01T00:00:00Z"}))).json()["jobId"]
    now = datetime.now(UTC)
    cases = [
        (cron_job, {"start": (now - timedelta(days=2)).isoformat(), "end": now.isoformat()}, "end", "more than"),
        (cron_job, {"start": now.isoformat(), "end": (now - timedelta(hours=1)).isoformat()}, "end", "after start"),
        (cron_job, {"start": now.isoformat(), "end": (now + timedelta(hours=1)).isoformat()}, "end", "past"),
        (cron_job, {"start": "2026-01-01T00:00:00", "end": now.isoformat()}, "start", "offset"),
        (once, {"start": (now - timedelta(hours=1)).isoformat(), "end": now.isoformat()}, "schedule", "cron"),
        (cron_job, {"start": "1969-12-31T23:00:00Z", "end": "1970-01-01T01:00:00Z"}, "start", "outside the times"),
        (cron_job, {"start": "0001-01-01T00:00:00+14:00", "end": now.isoformat()}, "start", "outside the times"),
    ]
    for job_id, body, field, words in cases:
        response = await client.post(f"/jobs/{job_id}/backfill", json=body)
        assert response.status_code == 422, (body, response.text)
        assert response.json()["field"] == field and words in response.json()["message"], response.json()
    assert await homes.total("SELECT count(*) FROM runs") == 0


async def test_queue_depth_per_tier_is_visible_to_admins(
    client: httpx.AsyncClient, target: Target, tokens: dict[str, str]
) -> None:
    for priority in ("high", "batch", "batch"):
        by = {"Authorization": f"Bearer {tokens['admin']}"} if priority == "high" else None  # an admin's grant
        job_id = (await client.post("/jobs", json=job(target, "/q", {"cron": "0 0 1 1 *"}, priority=priority),
                                    headers=by)).json()["jobId"]
        assert (await client.post(f"/jobs/{job_id}/runs", headers=by)).status_code == 202
    assert (await client.get("/queue")).status_code == 403
    tiers = (await client.get("/queue", headers={"Authorization": f"Bearer {tokens['admin']}"})).json()["tiers"]
    answered = datetime.now(UTC)
    assert [(t["tier"], t["depth"]) for t in tiers] == [("high", 1), ("normal", 0), ("batch", 2)]
    assert tiers[1]["oldestEnqueuedAt"] is None and tiers[1]["lagSec"] == 0
    # The lag is the wait of the oldest run of each tier: the high run was queued first.
    high, batch = (datetime.fromisoformat(tiers[i]["oldestEnqueuedAt"]) for i in (0, 2))
    assert high < batch
    assert 0 < tiers[2]["lagSec"] <= (answered - batch).total_seconds() + 0.001, tiers
    assert tiers[0]["lagSec"] - tiers[2]["lagSec"] == pytest.approx((batch - high).total_seconds(), abs=0.002)
