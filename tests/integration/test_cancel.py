"""Cancelling a running run reaches its worker at once, for every task type (real PostgreSQL, real API).

The worker heartbeats every 10 s here, as by default: a cancel noticed only by the heartbeat would
take up to that long. Each test asks for the task to be stopped within a couple of seconds, and for
the interrupted attempt to be recorded as cancelled, by whom.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import httpx
import pytest

from chimes.store.owners import OwnerStore
from chimes.worker.tasks.dispatch import Executors
from tests.fake_container_runtime import FakeRuntime, install_fake_runtime, pid_alive
from tests.helpers import Homes, wait_for
from tests.integration.fleet import FAST_WORKER, Fleet, running_fleet
from tests.target import Target

STOPPED_WITHIN_SEC = 2.5


@dataclass
class SlowFleet:
    fleet: Fleet
    runtime: FakeRuntime


@pytest.fixture
async def slow_fleet(pool: asyncpg.Pool, database_url: str, homes: Homes, tmp_path: Path) -> AsyncIterator[SlowFleet]:
    """A node and a worker whose heartbeat (10 s, the default) is far slower than a cancel must be."""
    await OwnerStore(pool).set("team-a", allow_commands=True)
    runtime = install_fake_runtime(tmp_path)
    config = replace(FAST_WORKER, heartbeat_every_sec=10.0, lease_sec=30.0, allow_commands=True)
    async with running_fleet(pool, database_url, homes, worker=config, executors=lambda: Executors(
            container_runtime=str(runtime.path), kill_grace_sec=1.0)) as fleet:
        await wait_for(fleet.listening, timeout=10, what="the worker to listen")
        yield SlowFleet(fleet, runtime)


def soon() -> dict[str, str]:
    return {"at": (datetime.now(UTC) + timedelta(seconds=0.3)).isoformat()}


async def running_run(client: httpx.AsyncClient, job_id: str) -> str:
    async def find() -> str | None:
        runs = (await client.get(f"/jobs/{job_id}/runs", params={"status": "running"})).json()["runs"]
        return runs[0]["runId"] if runs else None

    run_id: str = await wait_for(find, timeout=15, what="the run to be running")
    return run_id


async def cancel_and_check(client: httpx.AsyncClient, fleet: SlowFleet, run_id: str) -> float:
    """Cancel through the API; returns how long the worker took to let go of the run."""
    started = time.monotonic()
    answer = await client.post(f"/runs/{run_id}/cancel")
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] == "cancelled"
    await wait_for(lambda: not any(str(r) == run_id for r in fleet.fleet.running()), timeout=STOPPED_WITHIN_SEC,
                   what="the worker to stop the cancelled run")
    took = time.monotonic() - started
    run = (await client.get(f"/runs/{run_id}")).json()
    assert run["status"] == "cancelled" and run["error"] == "cancelled by team-a"
    [attempt] = run["attempts"]
    assert attempt["status"] == "cancelled", attempt
    assert attempt["error"] == "cancelled by team-a"
    assert attempt["workerId"] == "test-worker" and attempt["finishedAt"] is not None
    return took


async def test_cancel_stops_a_hanging_http_call_at_once(
    slow_fleet: SlowFleet, client: httpx.AsyncClient, target: Target
) -> None:
    target.delays["/hang"] = lambda n: 120
    job_id = (await client.post("/jobs", json={
        "name": "hangs", "schedule": soon(), "retryPolicy": {"maxAttempts": 1},
        "task": {"type": "http", "url": target.url + "/hang"}})).json()["jobId"]
    run_id = await running_run(client, job_id)
    await wait_for(lambda: target.calls_to("/hang"), timeout=10, what="the call to hang")
    await cancel_and_check(client, slow_fleet, run_id)


async def test_cancel_kills_a_commands_process_group_at_once(
    slow_fleet: SlowFleet, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pid"
    job_id = (await client.post("/jobs", json={
        "name": "sleeps", "schedule": soon(), "retryPolicy": {"maxAttempts": 1},
        "task": {"type": "command", "argv": ["/bin/sh", "-c", f"echo $$ > {pid_file}; exec sleep 300"]}})).json()
    run_id = await running_run(client, job_id["jobId"])
    pid = int(await wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), timeout=10,
                             what="the command to start"))
    await cancel_and_check(client, slow_fleet, run_id)
    await wait_for(lambda: not pid_alive(pid), timeout=STOPPED_WITHIN_SEC, what="the command's process to end")


async def test_cancel_stops_a_container_at_once(slow_fleet: SlowFleet, client: httpx.AsyncClient) -> None:
    job_id = (await client.post("/jobs", json={
        "name": "contained", "schedule": soon(), "retryPolicy": {"maxAttempts": 1},
        "task": {"type": "container", "image": "alpine:3", "command": ["/bin/sh", "-c", "exec sleep 300"]}})).json()
    run_id = await running_run(client, job_id["jobId"])
    record = await slow_fleet.runtime.started(f"chimes-{run_id}-1")
    await cancel_and_check(client, slow_fleet, run_id)
    await wait_for(lambda: not pid_alive(record["pid"]), timeout=STOPPED_WITHIN_SEC, what="the container to end")
    assert slow_fleet.runtime.calls()[1][0] == "stop"
