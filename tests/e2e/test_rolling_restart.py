"""A planned restart costs no slot: every-second jobs under the default concurrency policy (skip),
edited all along through two API processes, while each API process, each scheduler node and each
worker is stopped with SIGTERM and started again, one after the other, as the upgrade runbook does it.

A stopping node fires the slot under way, hands its partitions over and tells the other node, which
fires the next slot on time: no slot is late enough to find its previous run still active, so none
is skipped. A stopping worker finishes its runs; a stopping API finishes its requests, and the
editor, as a client behind a load balancer would, sends the next one to the other. Each slot has one
record, each run reached the target once. The first pass rolls every role once; the second (long)
rolls them round after round for about two minutes.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import signal
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from tests.e2e.processes import ChimesProcess, Processes
from tests.e2e.test_crash_safety import _all_finished, _split_between, pause_all
from tests.helpers import Homes, auth_as, free_port, wait_for
from tests.target import Target

pytestmark = pytest.mark.long  # every role rolled with SIGTERM while jobs fire

JOBS = 12


class Apis:
    """Two `chimes api` processes behind a client that sends each request to one of them, and to the
    other when that one is gone."""

    def __init__(self, processes: Processes, token: str) -> None:
        self.processes, self.headers = processes, auth_as(token)
        self.running: dict[str, tuple[ChimesProcess, int]] = {}

    async def start(self, name: str) -> None:
        port = free_port()
        process = self.processes.start(name, "api", "--port", str(port))
        self.running[name] = (process, port)
        await wait_for(lambda: self._answers(port), timeout=60, what=f"{name} to answer")

    async def _answers(self, port: int) -> bool:
        try:
            async with httpx.AsyncClient(timeout=5) as http:
                return (await http.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200
        except httpx.TransportError:
            return False

    async def restart(self, name: str, again: str) -> None:
        process, _ = self.running.pop(name)
        process.signal(signal.SIGTERM)
        assert await process.exited(timeout=30) == 0, process.output()[-2000:]
        await self.start(again)

    async def patch(self, job_id: str, change: dict, rng: random.Random) -> httpx.Response:
        ports = [port for _, port in self.running.values()]
        rng.shuffle(ports)
        failed: list[str] = []
        for port in ports:
            try:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=self.headers,
                                             timeout=30) as http:
                    return await http.patch(f"/jobs/{job_id}", json=change)
            except httpx.TransportError as exc:  # that one is restarting: the other takes the request
                failed.append(f"{port}: {exc!r}")
        raise AssertionError(f"no API took the edit: {failed}")


async def _restart(processes: Processes, process: ChimesProcess, name: str, role: str) -> ChimesProcess:
    process.signal(signal.SIGTERM)
    assert await process.exited(timeout=30) == 0
    return processes.scheduler(name) if role == "scheduler" else processes.worker(name, concurrency=50)


async def _edit_all_along(apis: Apis, job_ids: list[str], stop: asyncio.Event) -> int:
    """Tags, and by turns the start deadline (which the scheduler reads), of a random job at random
    instants: the edits land on due slots as well."""
    rng = random.Random(62)
    edits = 0
    while not stop.is_set():
        job_id = rng.choice(job_ids)
        change = {"tags": [f"roll-{edits}"]} if edits % 2 else {"startDeadlineSec": 30 + edits % 5}
        response = await apis.patch(job_id, change, rng)
        assert response.status_code == 200, response.text
        edits += 1
        await asyncio.sleep(rng.uniform(0.05, 0.3))
    return edits


@pytest.mark.parametrize("rounds", [
    1,
    pytest.param(6, marks=pytest.mark.sharded_pass, id="long"),  # about two minutes, in the second pass
])
async def test_a_rolling_restart_of_every_role_costs_no_slot(
    rounds: int, processes: Processes, client: httpx.AsyncClient, target: Target, homes: Homes,
    tokens: dict[str, str]
) -> None:
    apis = Apis(processes, tokens["team-a"])
    await asyncio.gather(apis.start("api-a0"), apis.start("api-b0"))
    nodes = [processes.scheduler("node-a0"), processes.scheduler("node-b0")]
    workers = [processes.worker("worker-a0", concurrency=50), processes.worker("worker-b0", concurrency=50)]
    await wait_for(lambda: _split_between(homes, 2), timeout=30, what="two nodes to share the partitions")
    job_ids = []
    for i in range(JOBS):
        created = await client.post("/jobs", json={"name": f"tick-{i}", "schedule": {"cron": "* * * * * *"},
                                                   "task": {"type": "http", "url": f"{target.url}/tick/{i}"}})
        assert created.status_code == 201, created.text
        job_ids.append(created.json()["jobId"])
    await wait_for(lambda: len(target.calls) >= 2 * JOBS, timeout=20, what="the jobs to run")
    begun = datetime.now(UTC)
    stop_editing = asyncio.Event()
    editing = asyncio.create_task(_edit_all_along(apis, job_ids, stop_editing))
    for round_ in range(1, rounds + 1):
        for side in "ab":
            await apis.restart(f"api-{side}{round_ - 1}", f"api-{side}{round_}")
        for index, side in enumerate("ab"):
            nodes[index] = await _restart(processes, nodes[index], f"node-{side}{round_}", "scheduler")
            await wait_for(lambda: _split_between(homes, 2), timeout=30, what=f"node-{side}{round_} to take its share")
        for index, side in enumerate("ab"):
            name = f"worker-{side}{round_}"
            workers[index] = await _restart(processes, workers[index], name, "worker")
            await wait_for(lambda n=name: _claimed_by(homes, n), timeout=30, what=f"{name} to run runs")
    stop_editing.set()
    assert await editing > 20 * rounds
    ended = datetime.now(UTC)
    await pause_all(client, job_ids)
    await wait_for(lambda: _all_finished(homes), timeout=30, what="every run to finish")

    first, last = begun.replace(microsecond=0) + timedelta(seconds=1), ended.replace(microsecond=0)
    for job_id in job_ids:
        home = await homes.for_job(uuid.UUID(job_id))
        rows = await home.fetch("SELECT scheduled_at, status, reason FROM runs WHERE job_id = $1 "
                                "AND scheduled_at BETWEEN $2 AND $3 ORDER BY scheduled_at",
                                uuid.UUID(job_id), first, last)
        times = [r["scheduled_at"] for r in rows]
        bounded = [first - timedelta(seconds=1), *times, last + timedelta(seconds=1)]
        gaps = [(a, b) for a, b in itertools.pairwise(bounded) if b - a != timedelta(seconds=1)]
        assert not gaps, f"job {job_id} has slots without a record between: {gaps}"
        skipped = [r["scheduled_at"] for r in rows if r["status"] != "succeeded"]
        if skipped:  # what the run before the first such slot did, for the failure's message
            before = await home.fetchrow("SELECT scheduled_at, fired_at, started_at, finished_at, worker_id, reason "
                                         "FROM runs WHERE job_id = $1 AND scheduled_at < $2 "
                                         "ORDER BY scheduled_at DESC LIMIT 1", uuid.UUID(job_id), skipped[0])
            first_skipped = await home.fetchrow("SELECT fired_at, reason, job_version FROM runs WHERE job_id = $1 "
                                                "AND scheduled_at = $2", uuid.UUID(job_id), skipped[0])
            raise AssertionError(f"job {job_id}: {len(skipped)} slots did not run, the first {skipped[0]} "
                                 f"({dict(first_skipped)}); the run before it: {dict(before) if before else None}")
    run_ids = [c.run_id for c in target.calls]
    assert len(run_ids) == len(set(run_ids)), "a run was delivered twice"


async def _claimed_by(homes: Homes, worker_id: str) -> bool:
    return await homes.total("SELECT count(*) FROM runs WHERE worker_id = $1", worker_id) > 0
