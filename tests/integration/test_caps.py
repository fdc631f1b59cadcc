"""Concurrency caps per tag and per owner: never exceeded, excess runs wait and all run in the end."""

from __future__ import annotations

import uuid

import asyncpg
import httpx

from tests.helpers import wait_for
from tests.integration.fleet import Fleet
from tests.target import Target


async def test_tag_cap_holds_across_the_fleet_and_nothing_is_dropped(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, pool: asyncpg.Pool
) -> None:
    await pool.execute("INSERT INTO concurrency_caps VALUES ('tag', 'db-heavy', 2)")
    target.delays["/heavy"] = lambda n: 1.0
    heavy = (await client.post("/jobs", json={"name": "heavy", "schedule": {"cron": "0 0 1 1 *"}, "tags": ["db-heavy"],
                                              "concurrency": "allow",
                                              "task": {"type": "http", "url": target.url + "/heavy"}})).json()
    light = (await client.post("/jobs", json={"name": "light", "schedule": {"cron": "0 0 1 1 *"},
                                              "concurrency": "allow",
                                              "task": {"type": "http", "url": target.url + "/light"}})).json()
    for _ in range(6):
        assert (await client.post(f"/jobs/{heavy['jobId']}/runs")).status_code == 202
    assert (await client.post(f"/jobs/{light['jobId']}/runs")).status_code == 202
    await wait_for(lambda: target.calls_to("/light"), timeout=10, what="the uncapped job, not held up")
    await wait_for(lambda: _succeeded(pool, heavy["jobId"], 6), timeout=30, what="every capped run, in the end")
    runs = await pool.fetch("SELECT started_at, finished_at FROM runs WHERE job_id = $1 ORDER BY started_at",
                            uuid.UUID(heavy["jobId"]))
    # At no instant were more than two running: check every start against the runs still going then.
    for run in runs:
        overlapping = [r for r in runs if r["started_at"] <= run["started_at"] < r["finished_at"]]
        assert len(overlapping) <= 2


async def _succeeded(pool: asyncpg.Pool, job_id: str, count: int) -> bool:
    return await pool.fetchval("SELECT count(*) FROM runs WHERE job_id = $1 AND status = 'succeeded'",
                               uuid.UUID(job_id)) >= count
