"""Container jobs run end to end: API, scheduler node, worker, run history (real PostgreSQL).

The worker's container runtime here is the stand-in CLI of :mod:`tests.fake_container_runtime`, which
runs each "container" as a local process, so these run on any machine; the same paths on a real
runtime (podman) are in ``test_container_podman.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import httpx
import pytest

from chimes.store.owners import OwnerStore
from chimes.worker.tasks.dispatch import Executors
from tests.fake_container_runtime import FakeRuntime, install_fake_runtime
from tests.helpers import Homes, wait_for
from tests.integration.fleet import FAST_WORKER, running_fleet


@pytest.fixture
async def fake(pool: asyncpg.Pool, database_url: str, homes: Homes, tmp_path: Path) -> AsyncIterator[FakeRuntime]:
    """A fleet whose worker runs container tasks through the stand-in CLI; team-a may create them."""
    await OwnerStore(pool).set("team-a", allow_commands=True)
    runtime = install_fake_runtime(tmp_path)
    async with running_fleet(pool, database_url, homes, worker=replace(FAST_WORKER, allow_commands=True),
                             executors=lambda: Executors(container_runtime=str(runtime.path))):
        yield runtime


def container_job(name: str, script: str, **extra: object) -> dict:
    at = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    task = {"type": "container", "image": "alpine:3", "command": ["/bin/sh", "-c", script]}
    return {"name": name, "schedule": {"at": at}, "task": task, "retryPolicy": {"maxAttempts": 1}} | extra


async def finished_run(client: httpx.AsyncClient, job_id: str) -> dict:
    async def done() -> dict | None:
        runs = (await client.get(f"/jobs/{job_id}/runs")).json()["runs"]
        finished = [r for r in runs if r["status"] in ("succeeded", "failed", "cancelled")]
        return (await client.get(f"/runs/{finished[0]['runId']}")).json() if finished else None

    run: dict = await wait_for(done, timeout=30, what="the container run to finish")
    return run


async def test_container_outlives_its_lease_and_succeeds(fake: FakeRuntime, client: httpx.AsyncClient) -> None:
    # The container runs longer than the 3 s run lease: only the worker's heartbeats keep the run its own.
    job = (await client.post("/jobs", json=container_job("long", 'sleep 4; echo "$CHIMES_RUN_ID"'))).json()
    run = await finished_run(client, job["jobId"])
    assert run["status"] == "succeeded", run
    [attempt] = run["attempts"]
    assert attempt["output"] == run["runId"] + "\n"
    assert [call[:4] for call in fake.calls()] == [["run", "--rm", "--name", f"chimes-{run['runId']}-1"]]


async def test_container_timeout_stops_the_container(fake: FakeRuntime, client: httpx.AsyncClient) -> None:
    job = (await client.post("/jobs", json=container_job("slow", "echo begun; exec sleep 60", timeoutSec=2))).json()
    run = await finished_run(client, job["jobId"])
    assert run["status"] == "failed"
    assert run["error"] == "timed out after 2s"
    assert run["attempts"][0]["output"] == "begun\n"
    assert fake.calls()[1][0] == "stop"
    await fake.all_gone()
