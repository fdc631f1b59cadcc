"""A fleet on a Patroni-managed PostgreSQL goes on through a planned switchover and the loss of its primary.

The cluster is real (chimes.ha: three etcd members, two PostgreSQL servers under Patroni in
synchronous mode, on 127.0.0.1); the roles are real processes given the two-host URL with
``target_session_attrs=read-write``. A job fires every second and one-off jobs are created all
along, one write at a time. First a planned switchover, then the primary's PostgreSQL and Patroni
are SIGKILLed (the host is gone) and Patroni promotes the synchronous standby; the killed member is
started again and rejoins as a standby (pg_rewind). Then: every job the API acknowledged ran, no
slot has two runs, the API answered only 2xx and 503 (never 500, never a hang past its timeout),
fires resumed within 20 s of each promotion, and no role exited. The timings are printed.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from chimes.ha.cluster import HaCluster
from chimes.ha.runtime import HaUnavailable, etcd_binary
from tests.e2e.failover import (
    REQUEST_TIMEOUT,
    Writer,
    all_acknowledged_ran_once,
    migrated_with_api,
    processes_for,
)
from tests.e2e.processes import ChimesProcess
from tests.helpers import auth_as, http_server, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.long]

@pytest.fixture
def cluster() -> Iterator[HaCluster]:
    try:
        etcd_binary()
    except HaUnavailable as exc:  # scripts/test installs Debian's etcd-server; elsewhere say what is missing
        pytest.skip(str(exc))
    # Not under pytest's tmp_path (its folders are private to root): the PostgreSQL user works here.
    base = Path(tempfile.mkdtemp(prefix="chimes-ha-"))
    ha = HaCluster(base, postgres=2)
    try:
        ha.start()
        yield ha
    finally:
        ha.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.timeout(420)  # the cluster's start (Patroni installed on the first), a TTL, two recoveries
async def test_a_fleet_goes_on_through_a_switchover_and_the_loss_of_its_primary(
        cluster: HaCluster, tmp_path: Path) -> None:
    calls: list[tuple[float, str]] = []

    async def handle(request: web.Request) -> web.Response:
        calls.append((time.time(), request.path))
        return web.Response(text="ok")

    async with http_server(handle) as target:
        await _through_a_switchover_and_a_failover(cluster, tmp_path, target, calls)


async def _through_a_switchover_and_a_failover(cluster: HaCluster, tmp_path: Path, target: str,
                                              calls: list[tuple[float, str]]) -> None:
    dsn = cluster.database_url()
    procs = processes_for(dsn, tmp_path)
    writer: Writer | None = None
    try:
        token, api_url, api = await migrated_with_api(procs, dsn)
        roles: list[ChimesProcess] = [
            api, procs.scheduler("node-1"), procs.scheduler("node-2"),
            procs.worker("worker-1", shutdown_grace=2), procs.worker("worker-2", shutdown_grace=2),
        ]
        async with httpx.AsyncClient(base_url=api_url, headers=auth_as(token),
                                     timeout=REQUEST_TIMEOUT + 15) as client:
            writer = Writer(client, target)
            await writer.api_up()
            tick = await writer.create("tick", {"cron": "* * * * * *"})
            assert tick.status_code == 201, tick.text
            await wait_for(lambda: any(path == "/tick" for _, path in calls), timeout=30, what="the first tick")
            await writer.start()
            timings: dict[str, float] = {}

            async def recovered(what: str, since: float) -> None:
                """Writes accepted and ticks delivered again after ``since`` (a new primary)."""
                write = await writer.accepted_after(since, what)
                tick_at = await wait_for(lambda: next((at for at, path in calls if path == "/tick" and at > since),
                                                      None), timeout=20, what=f"a tick delivered after the {what}")
                timings[f"{what}: first accepted write"] = write.ended - since
                timings[f"{what}: first delivered tick"] = tick_at - since

            # A planned switchover (patronictl switchover does the same through the REST API).
            started = time.time()
            await asyncio.to_thread(cluster.switchover)
            timings["switchover: new primary"] = time.time() - started
            await recovered("switchover", time.time())
            await asyncio.to_thread(cluster.wait_for_standbys, 120)

            # The primary's host is gone: PostgreSQL and its Patroni SIGKILLed.
            old = await asyncio.to_thread(cluster.wait_for_primary, 30)
            killed_at = time.time()
            old.kill()
            await asyncio.to_thread(cluster.wait_for_primary, 90, other_than=old)
            promoted_at = time.time()
            timings["failover: new primary"] = promoted_at - killed_at
            await recovered("failover", promoted_at)
            # The former primary comes back and rejoins as a standby.
            assert await asyncio.to_thread(cluster.restart_dead) == [old.name]
            await asyncio.to_thread(cluster.wait_for_standbys, 120)
            print("high-availability timings (s):", {k: round(v, 1) for k, v in timings.items()}, flush=True)

            await writer.stop()
            twice = await all_acknowledged_ran_once(dsn, writer.acknowledged)
        for role in roles:
            assert role.proc.poll() is None, f"{role.name} exited:\n{role.output()[-3000:]}"
    finally:
        if writer is not None:
            await writer.stop(cancel=True)
        procs.stop_all()

    assert twice == [], "a slot made two runs"
    writer.check_answers()
    assert timings["failover: first delivered tick"] < 20 and timings["switchover: first delivered tick"] < 20

