"""SIGTERM: a worker stops claiming, finishes what it can within the grace, hands the rest back."""

from __future__ import annotations

import signal
import uuid

import httpx

from tests.e2e.processes import Processes
from tests.e2e.test_crash_safety import soon
from tests.helpers import Homes, wait_for
from tests.target import Target


async def create(client: httpx.AsyncClient, target: Target, path: str) -> str:
    response = await client.post("/jobs", json={"name": path, "schedule": {"at": soon(0.3)},
                                                "task": {"type": "http", "url": target.url + path}})
    return response.json()["jobId"]


async def status_of(homes: Homes, job_id: str) -> str | None:
    return await homes.fetchval(job_id, "SELECT status FROM runs WHERE job_id = $1", uuid.UUID(job_id))


async def test_sigterm_lets_a_short_run_finish(
    processes: Processes, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    processes.scheduler("node-1")
    worker = processes.worker("worker-1", shutdown_grace=20)
    target.delays["/short"] = lambda n: 1.5
    job_id = await create(client, target, "/short")
    await wait_for(lambda: target.calls_to("/short"), timeout=20, what="the run to start")
    worker.signal(signal.SIGTERM)
    assert await worker.exited(timeout=20) == 0
    assert await status_of(homes, job_id) == "succeeded"
    assert "handed" not in worker.output()


async def test_sigterm_hands_a_long_run_back_to_another_worker(
    processes: Processes, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    processes.scheduler("node-1")
    worker = processes.worker("worker-1", shutdown_grace=0.5)
    target.delays["/long"] = lambda n: 60 if n == 1 else 0
    job_id = await create(client, target, "/long")
    await wait_for(lambda: target.calls_to("/long"), timeout=20, what="the run to start")
    worker.signal(signal.SIGTERM)
    assert await worker.exited(timeout=20) == 0
    assert "handed 1 unfinished runs back" in worker.output()
    assert await status_of(homes, job_id) == "scheduled"
    processes.worker("worker-2")
    await wait_for(lambda: _is(homes, job_id, "succeeded"), timeout=20, what="another worker to run it")
    run = await homes.fetchrow(job_id, "SELECT attempt, worker_id FROM runs WHERE job_id = $1", uuid.UUID(job_id))
    # Handed back, not failed: the interrupted attempt does not count against the retry budget.
    assert run["attempt"] == 1 and run["worker_id"] == "worker-2"


async def _is(homes: Homes, job_id: str, status: str) -> bool:
    return await status_of(homes, job_id) == status
