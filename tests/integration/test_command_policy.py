"""Command and container tasks: the API refuses them for owners the operator has not allowed, and a
worker runs them only when started with --allow-commands and only for allowed owners."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import asyncpg
import httpx
import pytest

from chimes.store.owners import OwnerStore
from tests.helpers import Homes, auth_as
from tests.integration.fleet import FAST_WORKER, running_fleet
from tests.integration.test_outgoing_calls import final_run, one_off


def touch_job(marker: Path) -> dict:
    return one_off("touch", {"type": "command", "argv": ["touch", str(marker)]})


@pytest.mark.parametrize("task", [{"type": "command", "argv": ["true"]},
                                  {"type": "container", "image": "alpine:3", "command": ["true"]}],
                         ids=["command", "container"])
async def test_the_api_refuses_command_jobs_of_owners_not_allowed(
    client: httpx.AsyncClient, pool: asyncpg.Pool, homes: Homes, task: dict
) -> None:
    refused = await client.post("/jobs", json=one_off("cmd", task))
    assert refused.status_code == 403
    assert refused.json() == {
        "error": "task_not_allowed", "field": "task.type",
        "message": f"owner 'team-a' may not run {task['type']} tasks: an operator allows it with "
                   "`chimes owner set team-a --allow-commands`",
    }
    assert await homes.total("SELECT count(*) FROM jobs") == 0
    await OwnerStore(pool).set("team-a", allow_commands=True)
    assert (await client.post("/jobs", json=one_off("cmd", task))).status_code == 201


async def test_an_http_job_cannot_be_turned_into_a_command_by_an_owner_not_allowed(
    client: httpx.AsyncClient, homes: Homes, tokens: dict[str, str]
) -> None:
    job = (await client.post("/jobs", json=one_off("web", {"type": "http", "url": "http://127.0.0.1:9/"}))).json()
    patched = await client.patch(f"/jobs/{job['jobId']}", json={"task": {"type": "command", "argv": ["id"]}})
    assert patched.status_code == 403 and patched.json()["error"] == "task_not_allowed"
    stored = await homes.fetchrow(job["jobId"], "SELECT task, version FROM jobs WHERE job_id = $1", job["jobId"])
    assert stored["task"]["type"] == "http" and stored["version"] == 1
    # Pausing (no new task) stays possible for a job whose owner lost the permission.
    assert (await client.patch(f"/jobs/{job['jobId']}", json={"paused": True})).status_code == 200


@pytest.fixture
async def node(pool: asyncpg.Pool, database_url: str, homes: Homes) -> AsyncIterator[None]:
    async with running_fleet(pool, database_url, homes, worker=None):
        yield


async def run_with_worker(pool: asyncpg.Pool, database_url: str, homes: Homes, client: httpx.AsyncClient, job: dict,
                          allow_commands: bool, worker_id: str = "w") -> dict:
    async with running_fleet(pool, database_url, homes, scheduler=None, worker_id=worker_id,
                             worker=replace(FAST_WORKER, allow_commands=allow_commands)):
        created = await client.post("/jobs", json=job)
        assert created.status_code == 201, created.text
        return await final_run(client, created.json()["jobId"])


async def test_a_worker_without_the_flag_refuses_command_tasks(
    node: None, pool: asyncpg.Pool, database_url: str, homes: Homes, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    await OwnerStore(pool).set("team-a", allow_commands=True)
    marker = tmp_path / "ran"
    run = await run_with_worker(pool, database_url, homes, client, touch_job(marker), allow_commands=False)
    assert run["status"] == "failed"
    assert run["error"] == ("refused: this worker does not run command tasks; start workers with --allow-commands "
                            "(CHIMES_ALLOW_COMMANDS=true) to run them")
    assert not marker.exists()


async def test_a_worker_with_the_flag_runs_them_for_allowed_owners_only(
    node: None, pool: asyncpg.Pool, database_url: str, homes: Homes, client: httpx.AsyncClient, tmp_path: Path,
    tokens: dict[str, str]
) -> None:
    owners = OwnerStore(pool)
    await owners.set("team-a", allow_commands=True)
    allowed = tmp_path / "allowed"
    assert (await run_with_worker(pool, database_url, homes, client, touch_job(allowed), True))["status"] == "succeeded"
    assert allowed.exists()
    # Written around the API (or allowed once, then withdrawn): the worker is the second line.
    created = await client.post("/jobs", json=touch_job(tmp_path / "withdrawn"))
    await owners.set("team-a", allow_commands=False)
    async with running_fleet(pool, database_url, homes, scheduler=None, worker_id="w2",
                             worker=replace(FAST_WORKER, allow_commands=True)):
        run = await final_run(client, created.json()["jobId"])
    assert run["status"] == "failed"
    assert run["error"] == ("refused: owner 'team-a' may not run command tasks; an operator allows it with "
                            "`chimes owner set team-a --allow-commands`")
    assert not (tmp_path / "withdrawn").exists()
    async with httpx.AsyncClient(base_url=str(client.base_url), headers=auth_as(tokens["team-b"])) as team_b:
        assert (await team_b.post("/jobs", json=touch_job(tmp_path / "b"))).status_code == 403
