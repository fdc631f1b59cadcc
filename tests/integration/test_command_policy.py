"""Command and container tasks: the API refuses them for owners the operator has not allowed, and a
worker runs them only when started with --allow-commands and only for allowed owners."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import asyncpg
import httpx
import pytest

from chimes.scheduler.node import SchedulerNode
from chimes.store.owners import OwnerStore
from chimes.worker.worker import Worker
from tests.helpers import auth_as
from tests.integration.fleet import FAST_SCHEDULER, FAST_WORKER
from tests.integration.test_outgoing_calls import final_run, one_off


def touch_job(marker: Path) -> dict:
    return one_off("touch", {"type": "command", "argv": ["touch", str(marker)]})


@pytest.mark.parametrize("task", [{"type": "command", "argv": ["true"]},
                                  {"type": "container", "image": "alpine:3", "command": ["true"]}],
                         ids=["command", "container"])
async def test_the_api_refuses_command_jobs_of_owners_not_allowed(
    client: httpx.AsyncClient, pool: asyncpg.Pool, task: dict
) -> None:
    refused = await client.post("/jobs", json=one_off("cmd", task))
    assert refused.status_code == 403
    assert refused.json() == {
        "error": "task_not_allowed", "field": "task.type",
        "message": f"owner 'team-a' may not run {task['type']} tasks: an operator allows it with "
                   "`chimes owner set team-a --allow-commands`",
    }
    assert await pool.fetchval("SELECT count(*) FROM jobs") == 0
    await OwnerStore(pool).set("team-a", allow_commands=True)
    assert (await client.post("/jobs", json=one_off("cmd", task))).status_code == 201


async def test_an_http_job_cannot_be_turned_into_a_command_by_an_owner_not_allowed(
    client: httpx.AsyncClient, pool: asyncpg.Pool, tokens: dict[str, str]
) -> None:
    job = (await client.post("/jobs", json=one_off("web", {"type": "http", "url": "http://127.0.0.1:9/"}))).json()
    patched = await client.patch(f"/jobs/{job['jobId']}", json={"task": {"type": "command", "argv": ["id"]}})
    assert patched.status_code == 403 and patched.json()["error"] == "task_not_allowed"
    stored = await pool.fetchrow("SELECT task, version FROM jobs WHERE job_id = $1", job["jobId"])
    assert stored["task"]["type"] == "http" and stored["version"] == 1
    # Pausing (no new task) stays possible for a job whose owner lost the permission.
    assert (await client.patch(f"/jobs/{job['jobId']}", json={"paused": True})).status_code == 200


@pytest.fixture
async def node(pool: asyncpg.Pool) -> AsyncIterator[None]:
    scheduler = SchedulerNode(pool, FAST_SCHEDULER, node_id="test-node")
    task = asyncio.create_task(scheduler.run())
    yield
    scheduler.stop()
    await task


async def run_with_worker(pool: asyncpg.Pool, database_url: str, client: httpx.AsyncClient, job: dict,
                          allow_commands: bool) -> dict:
    worker = Worker(pool, database_url, replace(FAST_WORKER, allow_commands=allow_commands), worker_id="w")
    running = asyncio.create_task(worker.run())
    try:
        created = await client.post("/jobs", json=job)
        assert created.status_code == 201, created.text
        return await final_run(client, created.json()["jobId"])
    finally:
        worker.stop()
        await running


async def test_a_worker_without_the_flag_refuses_command_tasks(
    node: None, pool: asyncpg.Pool, database_url: str, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    await OwnerStore(pool).set("team-a", allow_commands=True)
    marker = tmp_path / "ran"
    run = await run_with_worker(pool, database_url, client, touch_job(marker), allow_commands=False)
    assert run["status"] == "failed"
    assert run["error"] == ("refused: this worker does not run command tasks; start workers with --allow-commands "
                            "(CHIMES_ALLOW_COMMANDS=true) to run them")
    assert not marker.exists()


async def test_a_worker_with_the_flag_runs_them_for_allowed_owners_only(
    node: None, pool: asyncpg.Pool, database_url: str, client: httpx.AsyncClient, tmp_path: Path,
    tokens: dict[str, str]
) -> None:
    owners = OwnerStore(pool)
    await owners.set("team-a", allow_commands=True)
    allowed = tmp_path / "allowed"
    assert (await run_with_worker(pool, database_url, client, touch_job(allowed), True))["status"] == "succeeded"
    assert allowed.exists()
    # Written around the API (or allowed once, then withdrawn): the worker is the second line.
    created = await client.post("/jobs", json=touch_job(tmp_path / "withdrawn"))
    await owners.set("team-a", allow_commands=False)
    worker = Worker(pool, database_url, replace(FAST_WORKER, allow_commands=True), worker_id="w2")
    running = asyncio.create_task(worker.run())
    try:
        run = await final_run(client, created.json()["jobId"])
    finally:
        worker.stop()
        await running
    assert run["status"] == "failed"
    assert run["error"] == ("refused: owner 'team-a' may not run command tasks; an operator allows it with "
                            "`chimes owner set team-a --allow-commands`")
    assert not (tmp_path / "withdrawn").exists()
    async with httpx.AsyncClient(base_url=str(client.base_url), headers=auth_as(tokens["team-b"])) as team_b:
        assert (await team_b.post("/jobs", json=touch_job(tmp_path / "b"))).status_code == 403
