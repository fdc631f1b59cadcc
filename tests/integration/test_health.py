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
from tests.helpers import wait_for
from tests.integration.fleet import FAST_SCHEDULER, Fleet
from tests.target import Target


async def test_a_run_no_worker_starts_misses_its_deadline_and_is_notified(
    client: httpx.AsyncClient, target: Target, pool: asyncpg.Pool
) -> None:
    # A scheduler node and no worker at all: the run is enqueued and waits.
    config = SchedulerConfig(lease=FAST_SCHEDULER.lease, scan_every_sec=0.3, health_every_sec=0.5)
    node = SchedulerNode(pool, config, node_id="lonely-node")
    task = asyncio.create_task(node.run())
    try:
        at = (datetime.now(UTC) + timedelta(seconds=0.3)).isoformat()
        job_id = (await client.post("/jobs", json={
            "name": "unattended", "schedule": {"at": at}, "startDeadlineSec": 1, "notifyUrl": target.url + "/alerts",
            "task": {"type": "http", "url": target.url + "/work"}})).json()["jobId"]
        [alert] = await wait_for(lambda: target.calls_to("/alerts"), timeout=20, what="the missed-start notification")
    finally:
        node.stop()
        await task
    payload = orjson.loads(alert.body)
    assert payload["kind"] == "start_missed" and payload["jobId"] == job_id and payload["status"] == "scheduled"
    assert "are workers running" in payload["error"]
    assert target.calls_to("/work") == []


async def test_a_stuck_run_holding_a_skip_schedule_trips_the_dead_mans_switch(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, pool: asyncpg.Pool
) -> None:
    target.delays["/stuck"] = lambda n: 60
    job_id = (await client.post("/jobs", json={
        "name": "stuck", "schedule": {"cron": "* * * * * *"}, "concurrency": "skip",
        "notifyUrl": target.url + "/alerts", "task": {"type": "http", "url": target.url + "/stuck"}})).json()["jobId"]
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
