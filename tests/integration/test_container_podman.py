"""Container tasks on a real runtime: podman, through a real worker, scheduler node and API.

The image is a static busybox imported without a registry (:mod:`tests.podman_runtime`). These tests
skip, with the exact reason, only where podman cannot run (not installed, or refusing this host's
kernel); ``CHIMES_REQUIRE_PODMAN=1`` makes that a failure instead. Machines without podman still
cover the executor through the stand-in CLI (``test_container_runs.py``, ``unit/test_container_task.py``).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import httpx
import pytest

from chimes.scheduler.node import SchedulerNode
from chimes.store.owners import OwnerStore
from chimes.worker.tasks.dispatch import Executors
from chimes.worker.worker import Worker
from tests.helpers import wait_for
from tests.integration.fleet import FAST_SCHEDULER, FAST_WORKER
from tests.podman_runtime import IMAGE, REQUIRE_ENV, Podman, prepare

FINAL = ("succeeded", "failed", "cancelled")


@pytest.fixture(scope="session")
def podman() -> Iterator[Podman]:
    with tempfile.TemporaryDirectory(prefix="chimes-podman-") as folder:
        prepared = prepare(Path(folder))
        if isinstance(prepared, str):
            if os.environ.get(REQUIRE_ENV) == "1":
                pytest.fail(f"{REQUIRE_ENV}=1 but {prepared}")
            pytest.skip(prepared)
        yield prepared


@pytest.fixture
async def podman_fleet(podman: Podman, pool: asyncpg.Pool, database_url: str) -> AsyncIterator[Podman]:
    """A scheduler node and a worker whose container runtime is podman; team-a may run containers."""
    await OwnerStore(pool).set("team-a", allow_commands=True)
    node = SchedulerNode(pool, FAST_SCHEDULER, node_id="test-node")
    # A real runtime takes a second or two to stop a container: the reaper must not abandon the attempt
    # meanwhile (FAST_WORKER's grace past the timeout is 1 s, enough for the stand-in only).
    config = replace(FAST_WORKER, allow_commands=True, deadline_grace_sec=15.0)
    worker = Worker(pool, database_url, config, worker_id="test-worker",
                    executors=Executors(container_runtime=podman.runtime, kill_grace_sec=1.0))
    tasks = [asyncio.create_task(node.run()), asyncio.create_task(worker.run())]
    yield podman
    node.stop()
    worker.stop()
    for task in tasks:
        await task


def container_job(name: str, script: str, **extra: object) -> dict:
    at = (datetime.now(UTC) + timedelta(seconds=0.5)).isoformat()
    task = {"type": "container", "image": IMAGE, "command": ["/bin/sh", "-c", script]}
    task |= extra.pop("task", {})  # type: ignore[arg-type]
    return {"name": name, "schedule": {"at": at}, "task": task, "retryPolicy": {"maxAttempts": 1}} | extra


async def create(client: httpx.AsyncClient, job: dict) -> str:
    created = await client.post("/jobs", json=job)
    assert created.status_code == 201, created.text
    return str(created.json()["jobId"])


async def the_run(client: httpx.AsyncClient, job_id: str, statuses: tuple[str, ...] = FINAL) -> dict:
    async def reached() -> dict | None:
        runs = (await client.get(f"/jobs/{job_id}/runs")).json()["runs"]
        hit = [r for r in runs if r["status"] in statuses]
        return (await client.get(f"/runs/{hit[0]['runId']}")).json() if hit else None

    run: dict = await wait_for(reached, timeout=30, what=f"a run of {job_id} in {statuses}")
    return run


async def no_containers(podman: Podman, prefix: str) -> bool:
    return not await podman.names(prefix)


async def test_containers_run_with_env_secrets_and_exit_codes(podman_fleet: Podman, client: httpx.AsyncClient) -> None:
    script = 'echo "$PLAIN $API_KEY $CHIMES_RUN_ID $CHIMES_ATTEMPT"'
    ok = await create(client, container_job("env", script, task={"env": {"PLAIN": "p 1"},
                                                                  "secretEnv": {"API_KEY": "k-123"}}))
    three = await create(client, container_job("three", "echo failing; exit 3"))
    missing = await create(client, container_job("missing", "unused", task={"command": ["/bin/no-such-program"]}))
    no_image = await create(client, container_job("no-image", "true", task={"image": "localhost/chimes-absent:0"}))

    runs = []
    run = await the_run(client, ok)
    runs.append(run)
    assert run["status"] == "succeeded", run
    assert run["attempts"][0]["output"] == f"p 1 k-123 {run['runId']} 1\n"

    run = await the_run(client, three)
    runs.append(run)
    assert (run["status"], run["error"], run["attempts"][0]["output"]) == ("failed", "exit code 3", "failing\n")

    run = await the_run(client, missing)
    runs.append(run)
    assert run["status"] == "failed"
    assert run["error"].startswith("container runtime error (exit 127)"), run["error"]
    assert "no-such-program" in run["error"]

    run = await the_run(client, no_image)
    runs.append(run)
    assert run["status"] == "failed"
    assert run["error"].startswith("container runtime error (exit 125)"), run["error"]
    assert "chimes-absent" in run["error"]
    # --rm: nothing is left behind, whatever the outcome.
    for run in runs:  # only this test's: other test sessions may share the host's podman
        await wait_for(lambda: no_containers(podman_fleet, f"chimes-{run['runId']}"), timeout=10,  # noqa: B023
                       what="no containers left")


async def test_timeout_stops_the_container(podman_fleet: Podman, client: httpx.AsyncClient) -> None:
    job_id = await create(client, container_job("slow", "echo begun; exec sleep 60", timeoutSec=2))
    run = await the_run(client, job_id)
    assert (run["status"], run["error"]) == ("failed", "timed out after 2s")
    assert run["attempts"][0]["output"] == "begun\n"
    await wait_for(lambda: no_containers(podman_fleet, f"chimes-{run['runId']}"), timeout=15,
                   what="the timed-out container to be gone")


async def test_cancel_stops_the_container(podman_fleet: Podman, client: httpx.AsyncClient) -> None:
    job_id = await create(client, container_job("cancelled", "echo begun; exec sleep 60"))
    run = await the_run(client, job_id, ("running",))
    name = f"chimes-{run['runId']}-1"
    await wait_for(lambda: podman_fleet.names(name), timeout=15, what="the container to start")
    cancelled = await client.post(f"/runs/{run['runId']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
    # The worker sees the lease gone on its next heartbeat (0.5 s) and stops the container by name.
    await wait_for(lambda: no_containers(podman_fleet, name), timeout=15, what="the cancelled container to be gone")
