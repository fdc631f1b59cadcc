"""Concurrency caps per tag and per owner: never exceeded, excess runs wait and all run in the end."""

from __future__ import annotations

import uuid

import asyncpg
import httpx

from tests.helpers import Homes, auth_as, wait_for
from tests.integration.fleet import Fleet
from tests.target import Target


async def test_tag_cap_holds_across_the_fleet_and_nothing_is_dropped(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, pool: asyncpg.Pool,
    homes: Homes,
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
    await wait_for(lambda: _succeeded(homes, heavy["jobId"], 6), timeout=30, what="every capped run, in the end")
    home = await homes.for_job(uuid.UUID(heavy["jobId"]))
    runs = await home.fetch("SELECT started_at, finished_at FROM runs WHERE job_id = $1 ORDER BY started_at",
                            uuid.UUID(heavy["jobId"]))
    # At no instant were more than two running: check every start against the runs still going then.
    for run in runs:
        overlapping = [r for r in runs if r["started_at"] <= run["started_at"] < r["finished_at"]]
        assert len(overlapping) <= 2


async def _succeeded(homes: Homes, job_id: str, count: int) -> bool:
    return await homes.fetchval(job_id, "SELECT count(*) FROM runs WHERE job_id = $1 AND status = 'succeeded'",
                               uuid.UUID(job_id)) >= count


async def test_a_tag_cap_counts_only_its_owners_jobs(
    fleet: Fleet, client: httpx.AsyncClient, tokens: dict[str, str], target: Target, pool: asyncpg.Pool,
    homes: Homes,
) -> None:
    """team-a caps its `reports` jobs at one running; team-b's jobs tagged `reports` neither hold that
    slot nor fall under the cap. A fleet-wide cap on the same tag counts both."""
    await pool.execute("INSERT INTO concurrency_caps (scope, name, owner, max_running) VALUES ('tag', 'reports', "
                       "'team-a', 1)")
    target.delays["/b-report"] = lambda n: 3.0
    target.delays["/a-report"] = lambda n: 0.5

    def job(path: str) -> dict:
        return {"name": path, "schedule": {"cron": "0 0 1 1 *"}, "tags": ["reports"], "concurrency": "allow",
                "task": {"type": "http", "url": target.url + path}}

    b_job = (await client.post("/jobs", json=job("/b-report"), headers=auth_as(tokens["team-b"]))).json()["jobId"]
    a_job = (await client.post("/jobs", json=job("/a-report"))).json()["jobId"]
    for _ in range(3):
        assert (await client.post(f"/jobs/{b_job}/runs", headers=auth_as(tokens["team-b"]))).status_code == 202
    await wait_for(lambda: len(target.calls_to("/b-report")) == 3, timeout=10,
                   what="team-b's three runs, all at once: team-a's cap is not theirs")
    for _ in range(3):
        assert (await client.post(f"/jobs/{a_job}/runs")).status_code == 202
    await wait_for(lambda: target.calls_to("/a-report"), timeout=2.5,
                   what="team-a's run, while team-b's three still run: they hold none of its slots")
    await wait_for(lambda: _succeeded(homes, a_job, 3), timeout=30, what="team-a's runs, one at a time")
    runs = await (await homes.for_job(uuid.UUID(a_job))).fetch(
        "SELECT started_at, finished_at FROM runs WHERE job_id = $1", uuid.UUID(a_job))
    for run in runs:
        assert len([r for r in runs if r["started_at"] <= run["started_at"] < r["finished_at"]]) <= 1
    await wait_for(lambda: _succeeded(homes, b_job, 3), timeout=30, what="team-b's runs")

    # A fleet-wide cap on the tag (the operator's explicit choice) counts every owner's jobs.
    await pool.execute("DELETE FROM concurrency_caps")
    await pool.execute("INSERT INTO concurrency_caps (scope, name, owner, max_running) VALUES ('tag', 'reports', "
                       "'', 1)")
    for _ in range(2):
        assert (await client.post(f"/jobs/{b_job}/runs", headers=auth_as(tokens["team-b"]))).status_code == 202
    await wait_for(lambda: _succeeded(homes, b_job, 5), timeout=30, what="team-b's runs under the fleet-wide cap")
    b_runs = await (await homes.for_job(uuid.UUID(b_job))).fetch(
        "SELECT started_at, finished_at FROM runs WHERE job_id = $1 ORDER BY started_at DESC LIMIT 2", uuid.UUID(b_job))
    assert b_runs[0]["started_at"] >= b_runs[1]["finished_at"], "one at a time under the fleet-wide cap"
