"""The Patroni cluster restored to a point in time with ``chimes ha restore``: the drill, end to end.

A cluster of two PostgreSQL servers under Patroni with three etcd members (chimes.ha), archiving every
member's WAL into a backup repository with PostgreSQL's own tools; real ``chimes`` processes (API,
scheduler node, worker) on its two-host URL, a job firing every second. Then, through the CLI: a base
backup (``chimes ha backup``); jobs A created; the primary SIGKILLed, so that the segment it was
writing is never archived by it, and the standby promoted; more jobs A; the time T noted; jobs B
created; the roles and the cluster stopped. A restore with a segment missing from the archive fails,
saying so, and leaves the cluster as it was. ``chimes ha restore --to-time T`` then rebuilds it, and
on the cluster started again: every job A exists and no job B (nothing acknowledged before T lost:
the RPO), every run delivered before T is there, Patroni has a leader and a streaming standby, and
the scheduler fires again. The restore's wall time (the RTO's part) is printed.

The same drill by hand: docs/high-availability.md ("Restoring the cluster to a point in time").
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import httpx
import pytest
from aiohttp import web

from chimes.ha.cluster import HaCluster
from chimes.ha.repository import Repository
from chimes.ha.runtime import HaUnavailable, etcd_binary
from tests.e2e.failover import REQUEST_TIMEOUT, migrated_with_api, processes_for
from tests.helpers import auth_as, http_server, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.sharded_pass]

JOBS_EACH = 4  # of A before the failover, A after it, and B


@dataclass
class Cluster:
    data_dir: Path  # what chimes ha --data-dir is given; the cluster lives in data_dir/ha
    ha: HaCluster
    repo: Path


@dataclass
class Target:
    """The HTTP target: when each run reached it."""

    calls: list[tuple[float, str, str]] = field(default_factory=list)  # (wall time, path, run id)

    async def handle(self, request: web.Request) -> web.Response:
        self.calls.append((time.time(), request.path, request.headers.get("X-Chimes-Run-Id", "")))
        return web.Response(text="ok")


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    try:
        etcd_binary()
    except HaUnavailable as exc:  # scripts/test installs Debian's etcd-server; elsewhere say what is missing
        pytest.skip(str(exc))
    # Not under pytest's tmp_path (its folders are private to root): the PostgreSQL user works here.
    top = Path(tempfile.mkdtemp(prefix="chimes-ha-restore-"))
    ha = HaCluster(top / "ha", postgres=2, backup_repo=top / "repo")
    try:
        ha.start()
        yield Cluster(top, ha, top / "repo")
    finally:
        ha.stop()
        shutil.rmtree(top, ignore_errors=True)


async def chimes(*args: str, timeout: float = 300) -> tuple[int, str]:
    """A ``chimes`` command as an operator runs it; its exit code and what it printed."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "chimes", *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode or 0, out.decode(errors="replace")


@pytest.mark.timeout(600)  # two cluster starts, a base backup, a TTL, a failed and a real restore
async def test_the_cluster_is_restored_to_a_time_between_two_sets_of_writes(cluster: Cluster, tmp_path: Path) -> None:
    target = Target()
    async with http_server(target.handle) as url:
        await _drill(cluster, tmp_path, url, target)


async def _drill(cluster: Cluster, tmp_path: Path, url: str, target: Target) -> None:
    dsn = cluster.ha.database_url()
    procs = processes_for(dsn, tmp_path)
    try:
        token, api_url, _ = await migrated_with_api(procs, dsn)
        procs.scheduler("node-1")
        procs.worker("worker-1", shutdown_grace=2)
        async with httpx.AsyncClient(base_url=api_url, headers=auth_as(token), timeout=REQUEST_TIMEOUT + 15) as api:
            await _api_up(api)
            tick = await _create(api, url, "tick", "* * * * * *")
            await wait_for(lambda: any(path == "/tick" for _, path, _ in target.calls), timeout=30, what="a tick")

            code, said = await chimes("ha", "backup", "--data-dir", str(cluster.data_dir))
            assert code == 0, said
            jobs_a = [await _create(api, url, f"a-{n}") for n in range(JOBS_EACH)]

            # The primary's host is gone: its last segment is archived only by the standby it streamed to.
            old = await asyncio.to_thread(cluster.ha.wait_for_primary, 30)
            old.kill()
            await asyncio.to_thread(cluster.ha.wait_for_primary, 90, other_than=old)
            jobs_a += [await _create(api, url, f"a-after-failover-{n}", retry=True) for n in range(JOBS_EACH)]
            # A segment switch, so that the archive holds a segment after the one the failed restore hides.
            await _switch_wal(dsn)
            to_time = datetime.now(UTC)
            jobs_b = [await _create(api, url, f"b-{n}") for n in range(JOBS_EACH)]
        delivered_before = {run for at, path, run in target.calls if path == "/tick" and at < to_time.timestamp()}
        procs.stop_all()
        await asyncio.to_thread(cluster.ha.stop)

        await _a_restore_across_a_gap_fails_and_changes_nothing(cluster, to_time)

        began = time.monotonic()
        code, said = await chimes("ha", "restore", "--data-dir", str(cluster.data_dir),
                                  "--to-time", to_time.isoformat())
        restore_sec = time.monotonic() - began
        assert code == 0, said
        print(said, flush=True)
        began = time.monotonic()
        await asyncio.to_thread(cluster.ha.start)
        start_sec = time.monotonic() - began

        members = cluster.ha.members()
        assert sorted(m["role"] for m in members) == ["leader", "sync_standby"], members
        assert all(m["state"] in ("running", "streaming") for m in members), members
        restarted = time.time()
        procs.scheduler("node-2")  # with the same secret key as before
        procs.worker("worker-2", shutdown_grace=2)
        await wait_for(lambda: any(at > restarted and path == "/tick" for at, path, _ in target.calls), timeout=60,
                       what="the tick firing again after the restore")
        fired_sec = next(at for at, path, _ in target.calls if at > restarted and path == "/tick") - restarted

        kept = await _existing(dsn, [tick, *jobs_a, *jobs_b], delivered_before)
    finally:
        procs.stop_all()

    lost_jobs = {tick, *jobs_a} - kept.jobs
    assert not lost_jobs, f"{len(lost_jobs)} jobs acknowledged before the restore point are gone"
    assert not set(jobs_b) & kept.jobs, "jobs created after the restore point are there"
    assert delivered_before <= kept.runs, f"{len(delivered_before - kept.runs)} runs delivered before it are gone"
    print(f"ha restore drill: restore point {to_time.isoformat()}; lost before it: {len(lost_jobs)} jobs, "
          f"{len(delivered_before - kept.runs)} of {len(delivered_before)} delivered runs (RPO); "
          f"chimes ha restore {restore_sec:.1f} s, cluster start {start_sec:.1f} s, first tick {fired_sec:.1f} s "
          f"after the roles started (RTO); load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)


async def _a_restore_across_a_gap_fails_and_changes_nothing(cluster: Cluster, to_time: datetime) -> None:
    """Every archived copy of the first segment of the failover's timeline hidden: replay cannot go
    past it, PostgreSQL does not promote, and the command says so and leaves the cluster as it was."""
    repo = Repository(cluster.repo)
    first = min(path.name[8:24] for path in repo.archived_segments() if path.name.startswith("00000002")
                and len(path.name) == 24)
    hidden = [path for path in repo.archived_segments() if path.name[8:24] == first]
    for path in hidden:
        path.rename(path.with_name(f".hidden-{path.name}"))
    before = _folders(cluster)
    try:
        code, said = await chimes("ha", "restore", "--data-dir", str(cluster.data_dir), "--to-time",
                                  to_time.isoformat())
    finally:
        for path in hidden:
            path.with_name(f".hidden-{path.name}").rename(path)
    assert code == 1, said
    assert "recovery ended before configured recovery target was reached" in said, said
    assert "Nothing was changed" in said, said
    assert _folders(cluster) == before
    assert all((member.data_dir / "PG_VERSION").exists() for member in cluster.ha.postgres)
    assert cluster.ha.running() == []


def _folders(cluster: Cluster) -> dict[str, list[str]]:
    """Each member's folders, but the data directories a failed restore made (kept, renamed *.restore-*)."""
    return {member.name: sorted(p.name for p in member.dir.iterdir() if p.is_dir() and ".restore-" not in p.name)
            for member in cluster.ha.postgres}


async def _api_up(api: httpx.AsyncClient) -> None:
    async def healthy() -> bool:
        try:
            return (await api.get("/healthz")).status_code == 200
        except httpx.HTTPError:
            return False

    await wait_for(healthy, timeout=60, what="the API")


async def _create(api: httpx.AsyncClient, url: str, name: str, cron: str = "0 0 1 1 *", *, retry: bool = False) -> str:
    """A job, acknowledged (201); ``retry``: through a 503 while the new primary is taking over."""
    async def created() -> str | None:
        answer = await api.post("/jobs", headers={"Idempotency-Key": str(uuid.uuid4())}, json={
            "name": name, "schedule": {"cron": cron}, "task": {"type": "http", "url": f"{url}/{name}"}})
        if answer.status_code == 503 and retry:
            return None
        assert answer.status_code == 201, answer.text
        job_id: str = answer.json()["jobId"]
        return job_id

    job: str = await wait_for(created, timeout=60, what=f"job {name} created", interval=0.3)
    return job


async def _switch_wal(dsn: str) -> None:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        await conn.execute("SELECT pg_switch_wal()")
    finally:
        await conn.close()


@dataclass(frozen=True)
class Kept:
    jobs: set[str]
    runs: set[str]


async def _existing(dsn: str, jobs: list[str], runs: set[str]) -> Kept:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        found_jobs = await conn.fetch("SELECT job_id::text FROM jobs WHERE job_id = ANY($1::uuid[])", jobs)
        found_runs = await conn.fetch("SELECT run_id::text FROM runs WHERE run_id = ANY($1::uuid[])", list(runs))
    finally:
        await conn.close()
    return Kept({row[0] for row in found_jobs}, {row[0] for row in found_runs})
