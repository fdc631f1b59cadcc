"""Crash safety with real processes: SIGKILL and SIGSTOP scheduler nodes and workers mid-flight."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import httpx
import pytest

from chimes.store.owners import OwnerStore
from tests.e2e.processes import Processes
from tests.fake_container_runtime import install_fake_runtime
from tests.helpers import Homes, wait_for
from tests.target import Target

pytestmark = pytest.mark.long  # processes killed and stopped while jobs fire


def soon(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


async def partition_owners(pool: asyncpg.Pool) -> dict[str, int]:
    rows = await pool.fetch("SELECT owner, count(*) AS n FROM partition_leases WHERE expires_at > now() "
                            "GROUP BY owner")
    return {r["owner"]: r["n"] for r in rows if r["owner"]}


async def every_second_jobs(client: httpx.AsyncClient, target: Target, count: int) -> list[str]:
    return [
        (await client.post("/jobs", json={"name": f"tick-{i}", "schedule": {"cron": "* * * * * *"},
                                          "concurrency": "allow",  # every slot must make a run that runs
                                          "task": {"type": "http", "url": f"{target.url}/tick/{i}"}})).json()["jobId"]
        for i in range(count)
    ]


async def pause_all(client: httpx.AsyncClient, job_ids: list[str]) -> None:
    for job_id in job_ids:
        assert (await client.patch(f"/jobs/{job_id}", json={"paused": True})).status_code == 200


async def assert_every_slot_ran_once(homes: Homes, target: Target, job_ids: list[str]) -> None:
    """No fire lost: each job has a run for every second between its first and last run, exactly one,
    and every run reached the target exactly once (fast target, no retries)."""
    await wait_for(lambda: _all_finished(homes), timeout=30, what="every run to finish")
    for job_id in job_ids:
        home = await homes.for_job(uuid.UUID(job_id))
        rows = await home.fetch("SELECT scheduled_at, status FROM runs WHERE job_id = $1 ORDER BY scheduled_at",
                                uuid.UUID(job_id))
        times = [r["scheduled_at"] for r in rows]
        assert len(times) >= 5, f"job {job_id} ran only {len(times)} times"
        gaps = [(a, b) for a, b in itertools.pairwise(times) if b - a != timedelta(seconds=1)]
        assert not gaps, f"job {job_id} missed slots: {gaps}"
        assert {r["status"] for r in rows} == {"succeeded"}
    run_ids = [c.run_id for c in target.calls]
    assert len(run_ids) == len(set(run_ids)), "a run was delivered twice"
    assert len(run_ids) == await homes.total("SELECT count(*) FROM runs")


async def _all_finished(homes: Homes) -> bool:
    return await homes.total("SELECT count(*) FROM runs WHERE status IN ('scheduled', 'running')") == 0


async def test_worker_killed_mid_run_is_run_again_by_another_worker(
    processes: Processes, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    processes.scheduler("node-1")
    doomed = processes.worker("worker-1", lease_sec=2)
    target.delays["/long"] = lambda n: 60 if n == 1 else 0  # the first attempt hangs
    job = (await client.post("/jobs", json={"name": "long", "schedule": {"at": soon(0.5)},
                                            "task": {"type": "http", "url": f"{target.url}/long"}})).json()
    await wait_for(lambda: target.calls_to("/long"), timeout=20, what="the first worker to start the run")
    doomed.kill()
    processes.worker("worker-2", lease_sec=2)
    run = await wait_for(lambda: _run_with_status(homes, job["jobId"], "succeeded"), timeout=30,
                         what="another worker to finish the run")
    calls = target.calls_to("/long")
    assert len(calls) == 2
    assert calls[0].headers["Idempotency-Key"] == calls[1].headers["Idempotency-Key"] == str(run["run_id"])
    attempts = await homes.fetch("SELECT attempt, worker_id, status, error FROM run_attempt_history ORDER BY attempt")
    assert [(a["attempt"], a["worker_id"], a["status"]) for a in attempts] == [
        (1, "worker-1", "failed"), (2, "worker-2", "succeeded")]
    assert "stopped heartbeating" in attempts[0]["error"]


async def test_env_file_of_a_worker_killed_mid_container_run_is_removed_by_the_next_worker(
    processes: Processes, client: httpx.AsyncClient, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    # No container engine runs here: the stand-in CLI of tests/fake_container_runtime.py takes its place.
    (tmp_path / "runtime").mkdir()
    runtime = install_fake_runtime(tmp_path / "runtime")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"CHIMES_CONTAINER_RUNTIME": str(runtime.path), "TMPDIR": str(tmp)}
    await OwnerStore(pool).set("team-a", allow_commands=True)
    processes.scheduler("node-1")
    doomed = processes.start("worker-1", "worker", "--worker-id", "worker-1", "--allow-commands", env=env)
    task = {"type": "container", "image": "alpine:3", "command": ["sleep", "5"], "env": {"TOKEN": "s3cret"}}
    response = await client.post("/jobs", json={"name": "boxed", "schedule": {"at": soon(0.5)}, "task": task,
                                                "retryPolicy": {"maxAttempts": 1}})
    assert response.status_code == 201, response.text
    def written() -> list[Path]:  # the folder is made first, then the file in it, then its lines
        with contextlib.suppress(FileNotFoundError):
            return [f.parent for f in tmp.glob(f"chimes-env-{doomed.pid}-*/env") if f.read_text() == "TOKEN=s3cret\n"]
        return []

    [left] = await wait_for(written, timeout=20, what="the worker to write the run's env file")
    doomed.kill()
    assert (left / "env").exists()  # nothing ran to remove it
    processes.start("worker-2", "worker", "--worker-id", "worker-2", "--allow-commands", env=env)
    await wait_for(lambda: not left.exists(), timeout=30, what="the next worker to remove the env file")
    assert os.listdir(tmp) == []


async def _run_with_status(homes: Homes, job_id: str, status: str) -> asyncpg.Record | None:
    return await homes.fetchrow(job_id, "SELECT * FROM runs WHERE job_id = $1 AND status = $2",
                                uuid.UUID(job_id), status)


async def test_killed_scheduler_node_loses_no_fire(
    processes: Processes, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    doomed = processes.scheduler("node-a")
    processes.scheduler("node-b")
    processes.worker("worker-1")
    await wait_for(lambda: _split_between(homes, 2), timeout=30, what="two nodes to share the partitions")
    job_ids = await every_second_jobs(client, target, 16)
    await wait_for(lambda: _runs_at_least(homes, 16 * 3), timeout=20, what="runs from both nodes")
    doomed.kill()
    await wait_for(lambda: _split_between(homes, 1), timeout=20, what="the survivor to take every partition")
    taken_over = datetime.now(UTC)
    await wait_for(lambda: _every_job_ran_after(homes, job_ids, taken_over + timedelta(seconds=2)), timeout=20,
                   what="every job to run again after the takeover")
    await pause_all(client, job_ids)
    await assert_every_slot_ran_once(homes, target, job_ids)
    # Taken over within the lease TTL (3 s) plus a scan and a renewal: the worst fire lag shows it.
    worst = max(r["lag"] for r in await homes.fetch(
        "SELECT max(extract(epoch FROM fired_at - scheduled_at)) AS lag FROM runs") if r["lag"] is not None)
    assert worst < 8, f"worst fire lag {worst}s"


async def _every_job_ran_after(homes: Homes, job_ids: list[str], instant: datetime) -> bool:
    ran = await homes.total("SELECT count(DISTINCT job_id) FROM runs WHERE scheduled_at > $1 AND job_id = ANY($2)",
                            instant, [uuid.UUID(j) for j in job_ids])
    return ran == len(job_ids)


async def _split_between(homes: Homes, nodes: int) -> bool:
    """In every home (a scheduler process runs a node per home, each leasing its own rows)."""
    for home in await homes.homes():
        owners = await partition_owners(home)
        if not (len(owners) == nodes and sum(owners.values()) == 1024):
            return False
    return True


async def _runs_at_least(homes: Homes, count: int) -> bool:
    return await homes.total("SELECT count(*) FROM runs WHERE status = 'succeeded'") >= count


async def test_stopped_node_past_its_lease_is_fenced_out(
    processes: Processes, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    frozen = processes.scheduler("node-a")
    processes.scheduler("node-b")
    processes.worker("worker-1")
    await wait_for(lambda: _split_between(homes, 2), timeout=30, what="two nodes to share the partitions")
    job_ids = await every_second_jobs(client, target, 16)
    await wait_for(lambda: _runs_at_least(homes, 16 * 3), timeout=20, what="runs from both nodes")
    frozen.signal(signal.SIGSTOP)
    await wait_for(lambda: _owned_only_by(homes, "node-b"), timeout=20, what="node-b to take over")
    frozen.signal(signal.SIGCONT)
    await wait_for(lambda: "partitions: " in frozen.output() and _lost_partitions(frozen.output()), timeout=20,
                   what="the resumed node to notice it lost its partitions")
    await wait_for(lambda: _split_between(homes, 2), timeout=30, what="the partitions to be shared again")
    shared_again = datetime.now(UTC)
    await wait_for(lambda: _every_job_ran_after(homes, job_ids, shared_again + timedelta(seconds=2)), timeout=20,
                   what="every job to run again once both nodes share the work")
    await pause_all(client, job_ids)
    await assert_every_slot_ran_once(homes, target, job_ids)


async def _owned_only_by(homes: Homes, node: str) -> bool:
    return all([(await partition_owners(home)).get(node) == 1024 for home in await homes.homes()])


def _lost_partitions(log: str) -> bool:
    """A "partitions: N held (+a -b)" line with b > 0 (the log is JSON lines or text: match the message)."""
    return re.search(r"partitions: \d+ held \(\+\d+ -[1-9]\d*\)", log) is not None
