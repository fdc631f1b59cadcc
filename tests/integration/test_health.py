"""Schedule health: a run nobody starts, and a schedule held back by a stuck run, are notified."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx
import orjson

from chimes.scheduler.health import HealthCheck
from chimes.scheduler.node import SchedulerConfig, SchedulerNode
from tests.helpers import Homes, wait_for
from tests.integration.fleet import FAST_SCHEDULER, Fleet, running_fleet
from tests.target import Target


async def test_a_run_no_worker_starts_misses_its_deadline_and_is_notified(
    client: httpx.AsyncClient, target: Target, pool: asyncpg.Pool, database_url: str, homes: Homes
) -> None:
    # A scheduler node and no worker at all: the run is enqueued and waits.
    config = SchedulerConfig(lease=FAST_SCHEDULER.lease, scan_every_sec=0.3, health_every_sec=0.5)
    async with running_fleet(pool, database_url, homes, scheduler=config, worker=None, node_id="lonely-node"):
        at = (datetime.now(UTC) + timedelta(seconds=0.3)).isoformat()
        job_id = (await client.post("/jobs", json={
            "name": "unattended", "schedule": {"at": at}, "startDeadlineSec": 1, "notifyUrl": target.url + "/alerts",
            "task": {"type": "http", "url": target.url + "/work"}})).json()["jobId"]
        [alert] = await wait_for(lambda: target.calls_to("/alerts"), timeout=20, what="the missed-start notification")
    payload = orjson.loads(alert.body)
    assert payload["kind"] == "start_missed" and payload["jobId"] == job_id and payload["status"] == "scheduled"
    assert "are workers running" in payload["error"]
    assert target.calls_to("/work") == []


async def test_a_stuck_run_holding_a_skip_schedule_trips_the_dead_mans_switch(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    target.delays["/stuck"] = lambda n: 60
    job_id = (await client.post("/jobs", json={
        "name": "stuck", "schedule": {"cron": "* * * * * *"}, "concurrency": "skip",
        "notifyUrl": target.url + "/alerts", "task": {"type": "http", "url": target.url + "/stuck"}})).json()["jobId"]
    pool = await homes.for_job(job_id)  # the job's database
    await wait_for(lambda: target.calls_to("/stuck"), timeout=10, what="the run that hangs")
    health = HealthCheck(pool, grace=timedelta(seconds=1))
    # One-second interval plus one second of grace: a few skipped fires later, it is stalled.
    queued = await wait_for(lambda: health.sweep(datetime.now(UTC)), timeout=15, what="the stall to be seen")
    assert queued == 1
    assert await health.sweep(datetime.now(UTC)) == 0  # once per stuck run, not once per sweep
    row = await pool.fetchrow("SELECT * FROM notifications")
    assert row["kind"] == "schedule_stalled" and row["job_id"] == uuid.UUID(job_id)
    assert "no run has started since" in row["payload"]["error"]
    skipped = await pool.fetchval("SELECT count(*) FROM runs WHERE job_id = $1 AND status = 'skipped'",
                                  uuid.UUID(job_id))
    assert skipped >= 1
    await client.patch(f"/jobs/{job_id}", json={"paused": True})


def every_second(target: Target, name: str, **extra: object) -> dict:
    return {"name": name, "schedule": {"cron": "* * * * * *"}, "notifyUrl": target.url + "/alerts",
            "task": {"type": "http", "url": target.url + "/work"}} | extra


async def _stall_notifications(pool: asyncpg.Pool, job_id: str) -> list[asyncpg.Record]:
    return await pool.fetch("SELECT * FROM notifications WHERE job_id = $1 AND kind = 'schedule_stalled'",
                            uuid.UUID(job_id))


async def test_the_sweep_for_missing_triggers_counts_schedule_triggers_only(
    client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    # Answered from the indexes (jobs_pkey, triggers_job_kind): a pending retry is not a schedule.
    lost = (await client.post("/jobs", json=every_second(target, "retry-only"))).json()["jobId"]
    pool = await homes.for_job(lost)  # the job's database
    kept = (await client.post("/jobs", json=every_second(target, "far-off", schedule={"cron": "0 0 1 1 *"}))).json()
    assert await pool.execute("UPDATE triggers SET kind = 1 WHERE job_id = $1", uuid.UUID(lost)) == "UPDATE 1"
    health = HealthCheck(pool, grace=timedelta(seconds=1))
    assert await wait_for(lambda: health.sweep(datetime.now(UTC)), timeout=15, what="the stall to be seen") == 1
    stalls = await pool.fetch("SELECT job_id, cause FROM schedule_stalls")
    assert [(str(r["job_id"]), r["cause"]) for r in stalls] == [(lost, "no_trigger")]
    assert kept["nextRunAt"] is not None


async def test_a_schedule_whose_trigger_row_is_gone_trips_the_dead_mans_switch_once(
    client: httpx.AsyncClient, target: Target, homes: Homes, api_url: str, tokens: dict[str, str]
) -> None:
    job_id = (await client.post("/jobs", json=every_second(target, "lost-trigger"))).json()["jobId"]
    pool = await homes.for_job(job_id)  # the job's database
    assert await pool.execute("DELETE FROM triggers WHERE job_id = $1", uuid.UUID(job_id)) == "DELETE 1"
    health = HealthCheck(pool, grace=timedelta(seconds=1))
    # No fire since it was created: after its one-second period plus one second of grace, it is stalled.
    assert await wait_for(lambda: health.sweep(datetime.now(UTC)), timeout=15, what="the stall to be seen") == 1
    assert await health.sweep(datetime.now(UTC)) == 0  # once per incident, not once per sweep
    [alert] = await _stall_notifications(pool, job_id)
    assert "the job's trigger is missing" in alert["payload"]["error"] and alert["payload"]["jobName"] == "lost-trigger"
    assert await pool.fetchval("SELECT cause FROM schedule_stalls WHERE job_id = $1", uuid.UUID(job_id)) == "no_trigger"
    # The dashboard shows it: in the "stalled" filter of the jobs list, and on the job's page.
    async with httpx.AsyncClient(base_url=api_url) as browser:
        await browser.post("/ui/login", data={"token": tokens["team-a"], "next": "/ui/jobs"})
        listed = await browser.get("/ui/jobs", params={"show": "stalled"})
        assert "lost-trigger" in listed.text
        page = await browser.get(f"/ui/jobs/{job_id}")
        assert "Stalled schedule" in page.text and "the job&#39;s trigger is missing" in page.text
    # Pausing ends the incident: the job is no longer listed as stalled.
    await client.patch(f"/jobs/{job_id}", json={"paused": True})
    await health.sweep(datetime.now(UTC))
    assert await pool.fetchval("SELECT count(*) FROM schedule_stalls") == 0


async def test_a_schedule_whose_partition_has_no_owner_trips_the_dead_mans_switch_until_it_fires_again(
    client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    # No scheduler node at all: no partition has an owner, the trigger stays due.
    job_id = (await client.post("/jobs", json=every_second(target, "orphaned"))).json()["jobId"]
    pool = await homes.for_job(job_id)  # the job's database
    health = HealthCheck(pool, grace=timedelta(seconds=1))
    assert await wait_for(lambda: health.sweep(datetime.now(UTC)), timeout=15, what="the stall to be seen") >= 1
    [alert] = await _stall_notifications(pool, job_id)
    assert "has no live scheduler node" in alert["payload"]["error"]
    stall = await pool.fetchrow("SELECT * FROM schedule_stalls WHERE job_id = $1", uuid.UUID(job_id))
    assert stall["cause"] == "overdue"
    await health.sweep(datetime.now(UTC))
    assert len(await _stall_notifications(pool, job_id)) == 1  # still the same incident
    # A node comes and fires it: the incident is over, and a new one needs the schedule to fire first.
    node = SchedulerNode(pool, FAST_SCHEDULER, node_id="late-node")
    task = asyncio.create_task(node.run())
    try:
        await wait_for(lambda: pool.fetchval("SELECT count(*) FROM runs WHERE job_id = $1", uuid.UUID(job_id)),
                       timeout=15, what="the schedule to fire again")
        await health.sweep(datetime.now(UTC))
        assert await pool.fetchval("SELECT count(*) FROM schedule_stalls") == 0
        assert len(await _stall_notifications(pool, job_id)) == 1
    finally:
        node.stop()
        await task
    await client.patch(f"/jobs/{job_id}", json={"paused": True})


async def test_the_stuck_run_stall_is_shown_as_held(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    target.delays["/work"] = lambda n: 60
    job_id = (await client.post("/jobs", json=every_second(target, "held"))).json()["jobId"]
    pool = await homes.for_job(job_id)  # the job's database
    await wait_for(lambda: target.calls_to("/work"), timeout=10, what="the run that hangs")
    health = HealthCheck(pool, grace=timedelta(seconds=1))
    assert await wait_for(lambda: health.sweep(datetime.now(UTC)), timeout=15, what="the stall to be seen") == 1
    stall = await pool.fetchrow("SELECT * FROM schedule_stalls WHERE job_id = $1", uuid.UUID(job_id))
    assert stall["cause"] == "held" and "still holding the schedule" in stall["detail"]
    await client.patch(f"/jobs/{job_id}", json={"paused": True})


async def test_a_run_fired_late_misses_its_start_deadline_even_if_a_worker_takes_it_at_once(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    # Its time passed 20 s ago (as if its partition had had no owner): fired now, started at once.
    at = (datetime.now(UTC) - timedelta(seconds=20)).isoformat()
    job_id = (await client.post("/jobs", json={
        "name": "late", "schedule": {"at": at}, "startDeadlineSec": 5, "notifyUrl": target.url + "/alerts",
        "task": {"type": "http", "url": target.url + "/work"}})).json()["jobId"]
    [alert] = await wait_for(lambda: target.calls_to("/alerts"), timeout=20, what="the missed-start notification")
    payload = orjson.loads(alert.body)
    assert payload["kind"] == "start_missed" and payload["jobId"] == job_id
    assert "after its scheduled time, past its start deadline of 5s" in payload["error"]
    assert target.calls_to("/work")  # the run did start, late


async def test_a_slot_never_enqueued_misses_its_start_deadline(
    client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    # No scheduler node: the trigger is never fired, so no run exists to wait in the queue.
    at = (datetime.now(UTC) + timedelta(seconds=0.2)).isoformat()
    job_id = (await client.post("/jobs", json={
        "name": "never", "schedule": {"at": at}, "startDeadlineSec": 1, "notifyUrl": target.url + "/alerts",
        "task": {"type": "http", "url": target.url + "/work"}})).json()["jobId"]
    pool = await homes.for_job(job_id)  # the job's database
    health = HealthCheck(pool)
    assert await wait_for(lambda: health.sweep(datetime.now(UTC)), timeout=15, what="the missed start") == 1
    assert await health.sweep(datetime.now(UTC)) == 0
    row = await pool.fetchrow("SELECT * FROM notifications WHERE job_id = $1", uuid.UUID(job_id))
    assert row["kind"] == "start_missed" and "has no live scheduler node" in row["payload"]["error"]
    assert await pool.fetchval("SELECT count(*) FROM runs") == 0
