"""`chimes up --processes` runs its scheduler and worker as child processes it supervises: stopping it
stops them all, a child that dies takes it down; by default every role runs in the one process."""

from __future__ import annotations

import re
import signal
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx
import psutil
import pytest

from tests.e2e.processes import ChimesProcess, Processes
from tests.helpers import free_port, wait_for
from tests.target import Target

TOKEN = re.compile(r"^\s+(chm_\S+)\s*$", re.MULTILINE)

pytestmark = pytest.mark.single_database("reads the workers and partition_leases rows of the one database")


async def _healthy(base: str) -> bool:
    try:
        async with httpx.AsyncClient(base_url=base) as http:
            return (await http.get("/healthz")).status_code == 200
    except httpx.TransportError:
        return False


def _roles(up: ChimesProcess) -> dict[str, psutil.Process] | None:
    """The up process's children by role, once both are running."""
    children = {child.cmdline()[-1]: child for child in psutil.Process(up.pid).children()}
    return children if set(children) == {"scheduler", "worker"} else None


def _gone(proc: psutil.Process) -> bool:
    """Exited (and reaped), or a zombie: not the same process running any more."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def _start_up(processes: Processes, *args: str) -> tuple[ChimesProcess, str]:
    port = free_port()
    up = processes.start("up", "up", "--port", str(port), *args)
    base = f"http://127.0.0.1:{port}"
    await wait_for(lambda: _healthy(base), timeout=60, what="the API of chimes up")
    return up, base


async def test_up_with_processes_runs_scheduler_and_worker_as_children_and_stops_them_all(
    processes: Processes, database_url: str, target: Target
) -> None:
    up, base = await _start_up(processes, "--processes", "--worker-concurrency", "7")
    roles = await wait_for(lambda: _roles(up), timeout=30, what="the scheduler and worker processes")
    pids = {role: proc.pid for role, proc in roles.items()}
    assert up.pid not in pids.values()

    conn = await asyncpg.connect(database_url)
    try:
        # The worker that registered is the child, with up's --worker-concurrency handed on to it.
        worker = await wait_for(lambda: conn.fetchrow("SELECT worker_id, pid, concurrency FROM workers"),
                                timeout=30, what="the worker to register")
        assert (worker["pid"], worker["concurrency"]) == (pids["worker"], 7)
        owners = await wait_for(lambda: conn.fetch("SELECT DISTINCT owner FROM partition_leases WHERE owner IS "
                                                   "NOT NULL"), timeout=30, what="the partitions to be leased")
        assert [f"-{pids['scheduler']}-" in row["owner"] for row in owners] == [True]

        token = TOKEN.search(up.output())
        assert token is not None, up.output()[-4000:]
        async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {token.group(1)}"}) as http:
            at = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
            created = await http.post("/jobs", json={"name": "hello", "schedule": {"at": at},
                                                     "task": {"type": "http", "url": f"{target.url}/hello"}})
            assert created.status_code == 201, created.text
        await wait_for(lambda: target.calls_to("/hello"), timeout=30, what="the job to call the target")
        ran_on = await wait_for(lambda: conn.fetchval("SELECT worker_id FROM runs WHERE status = 'succeeded'"),
                                timeout=30, what="the run to be recorded as succeeded")
        assert ran_on == worker["worker_id"]
    finally:
        await conn.close()

    up.signal(signal.SIGTERM)
    assert await up.exited(timeout=90) == 0, up.output()[-4000:]
    for role, proc in roles.items():
        assert _gone(proc), f"the {role} process (pid {proc.pid}) outlived chimes up"


async def test_a_child_that_dies_stops_chimes_up_with_a_line_naming_it(processes: Processes) -> None:
    up, _ = await _start_up(processes, "--processes")
    roles = await wait_for(lambda: _roles(up), timeout=30, what="the scheduler and worker processes")

    roles["worker"].kill()
    assert await up.exited(timeout=90) == 1, up.output()[-4000:]
    assert f"the worker process (pid {roles['worker'].pid}) was killed by SIGKILL: chimes up stops" in up.output()
    assert _gone(roles["scheduler"]), "the scheduler outlived chimes up"


async def test_children_stop_when_chimes_up_is_killed_outright(processes: Processes) -> None:
    up, _ = await _start_up(processes, "--processes")
    roles = await wait_for(lambda: _roles(up), timeout=30, what="the scheduler and worker processes")

    up.signal(signal.SIGKILL)  # no chance to pass the stop on: the kernel's parent-death signal does
    assert await up.exited(timeout=30) == -signal.SIGKILL
    for role, proc in roles.items():
        await wait_for(lambda proc=proc: _gone(proc), timeout=60, what=f"the {role} process to stop")


async def test_by_default_every_role_runs_in_the_up_process(
    processes: Processes, database_url: str
) -> None:
    up, _ = await _start_up(processes)
    conn = await asyncpg.connect(database_url)
    try:
        worker_pid = await wait_for(lambda: conn.fetchval("SELECT pid FROM workers"), timeout=30,
                                    what="the worker to register")
    finally:
        await conn.close()
    assert worker_pid == up.pid
    assert psutil.Process(up.pid).children() == []
    up.signal(signal.SIGTERM)
    assert await up.exited(timeout=60) == 0, up.output()[-4000:]
