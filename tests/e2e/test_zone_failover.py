"""Losing the primary's zone, with Patroni: a new primary in another zone, the fleet goes on, the old
primary comes back as a standby, and nothing it took after the cut was acknowledged.

Three zones in network namespaces on a bridge (tests/e2e/zones.py). Each holds an etcd member, a
scheduler node and a worker; zones 1 and 2 also hold a PostgreSQL server under Patroni (synchronous
mode; a third server would be one more PostgreSQL on a 2-core machine). The API and the HTTP target
are on the host side of the bridge, as a fourth zone. The primary's zone is cut off (packets
dropped, no resets) for longer than Patroni's TTL and the lease TTL, then healed. Then: a primary
in the other zone; writes, fires and deliveries resumed; every job the API acknowledged ran, those
created while the old primary was isolated included; no slot has two runs; the API answered only
201 or 503; after the heal the old primary is a streaming standby (pg_rewind) and the cut zone's node
and worker work again, without a restart; no role exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import httpx
import pytest
from aiohttp import web
from cryptography.fernet import Fernet

from chimes.ha.cluster import HaCluster
from chimes.ha.runtime import HaUnavailable, etcd_binary
from chimes.store.tokens import create_token
from tests.e2e.processes import ChimesProcess, Processes
from tests.e2e.test_high_availability import REQUEST_TIMEOUT, Write
from tests.e2e.zones import Zones, ZonesUnavailable, check_can_make_zones
from tests.helpers import auth_as, free_port, wait_for

pytestmark = pytest.mark.e2e

ZONES = 3
LEASE_TTL = 3.0


@pytest.fixture
def zoned_cluster() -> Iterator[tuple[Zones, HaCluster]]:
    try:
        check_can_make_zones()
        etcd_binary()
    except (ZonesUnavailable, HaUnavailable) as exc:
        pytest.skip(f"cannot build zones with Patroni here: {exc}")
    zones = Zones(ZONES)
    base = Path(tempfile.mkdtemp(prefix="chimes-ha-zones-"))
    cluster: HaCluster | None = None
    try:
        zones.make()
        hosts = [zones.address(z) for z in range(1, ZONES + 1)]
        cluster = HaCluster(base, postgres=2, hosts=hosts, allowed_networks=[f"10.213.{zones.subnet}.0/24"],
                            prefixes={zones.address(z): ["ip", "netns", "exec", zones.namespace(z)]
                                      for z in range(1, ZONES + 1)})
        cluster.start()
        yield zones, cluster
    finally:
        if cluster is not None:
            for zone in range(1, ZONES + 1):
                zones.heal(zone)
            cluster.stop()
        left = zones.remove()
        shutil.rmtree(base, ignore_errors=True)
        assert not left, f"could not remove {left}"


@pytest.mark.timeout(480)
async def test_losing_the_primary_zone_moves_the_primary_and_loses_nothing_acknowledged(
        zoned_cluster: tuple[Zones, HaCluster], tmp_path: Path) -> None:
    zones, cluster = zoned_cluster
    calls: list[tuple[float, str]] = []

    async def handle(request: web.Request) -> web.Response:
        calls.append((time.time(), request.path))
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, zones.host_address, 0)  # reachable from every zone
    await site.start()
    target = f"http://{zones.host_address}:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        await _cut_the_primary_zone(zones, cluster, tmp_path, target, calls)
    finally:
        await runner.cleanup()


async def _cut_the_primary_zone(zones: Zones, cluster: HaCluster, tmp_path: Path, target: str,
                                calls: list[tuple[float, str]]) -> None:
    dsn = cluster.database_url()
    procs = Processes(dsn, tmp_path)
    procs.env.update({"CHIMES_SECRET_KEY": Fernet.generate_key().decode(), "CHIMES_DATA_DIR": str(tmp_path / "d")})
    writer: asyncio.Task[None] | None = None
    writes: list[Write] = []
    try:
        migrate = procs.start("migrate", "migrate")
        assert await migrate.exited(60) == 0, migrate.output()
        conn = await asyncpg.connect(dsn, timeout=10)
        token = await create_token(conn, "team", admin=False)
        await conn.close()
        api_port = free_port()
        roles: list[ChimesProcess] = [procs.start("api", "api", "--host", "127.0.0.1", "--port", str(api_port))]
        for zone in range(1, ZONES + 1):
            inside = ["ip", "netns", "exec", zones.namespace(zone)]
            roles += [procs.start(f"node-z{zone}", "scheduler", "--node-id", f"node-z{zone}", "--lease-ttl",
                                  str(LEASE_TTL), prefix=inside),
                      procs.start(f"worker-z{zone}", "worker", "--worker-id", f"worker-z{zone}", "--lease-sec", "5",
                                  "--shutdown-grace", "2", prefix=inside)]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{api_port}", headers=auth_as(token),
                                     timeout=REQUEST_TIMEOUT + 15) as client:
            async def healthy() -> bool:
                with contextlib.suppress(httpx.HTTPError):
                    return (await client.get("/healthz")).status_code == 200
                return False

            await wait_for(healthy, timeout=60, what="the API to start")

            async def create(name: str, schedule: dict) -> httpx.Response:
                return await client.post("/jobs", headers={"Idempotency-Key": str(uuid.uuid4())}, json={
                    "name": name, "schedule": schedule, "concurrency": "allow",
                    "task": {"type": "http", "url": f"{target}/{name}"}})

            tick = await create("tick", {"cron": "* * * * * *"})
            assert tick.status_code == 201, tick.text
            await wait_for(lambda: any(path == "/tick" for _, path in calls), timeout=30, what="the first tick")
            stop_writing = asyncio.Event()

            async def keep_writing() -> None:
                n = 0
                while not stop_writing.is_set():
                    n += 1
                    started = time.time()
                    try:
                        at = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
                        answer = await create(f"once-{n}", {"at": at})
                        job_id = answer.json().get("jobId") if answer.status_code == 201 else None
                        writes.append(Write(started, time.time(), answer.status_code, job_id))
                    except httpx.HTTPError:
                        writes.append(Write(started, time.time(), None, None))
                    await asyncio.sleep(0.3)  # a client's pace between writes, not a wait for a condition

            writer = asyncio.create_task(keep_writing())
            await wait_for(lambda: len(writes) >= 3, timeout=20, what="the first writes")

            old = await asyncio.to_thread(cluster.wait_for_primary, 30)
            lost_zone = 1 + [zones.address(z) for z in range(1, ZONES + 1)].index(old.layout.host)
            timeline = (old.state() or {}).get("timeline", 0)
            cut_at = time.time()
            zones.cut(lost_zone)
            new = await asyncio.to_thread(cluster.wait_for_primary, 120, after_timeline=timeline)
            promoted_at = time.time()
            assert new is not old
            write = await wait_for(lambda: next((w for w in writes if w.status == 201 and w.started >= promoted_at),
                                                None), timeout=30, what="a write accepted after the promotion")
            tick_at = await wait_for(lambda: next((at for at, path in calls if path == "/tick" and at > promoted_at),
                                                  None), timeout=20, what="a tick delivered after the promotion")
            timings = {"cut to new primary": promoted_at - cut_at,
                       "promotion to first accepted write": write.ended - promoted_at,
                       "promotion to first delivered tick": tick_at - promoted_at}

            # The zone comes back: the old primary rejoins as a standby, its node and worker work again.
            healed_at = datetime.now(UTC)
            zones.heal(lost_zone)
            await asyncio.to_thread(cluster.wait_for_standbys, 180)
            timings["heal to standby streaming"] = time.time() - healed_at.timestamp()
            conn = await asyncpg.connect(dsn, timeout=10)
            try:
                async def zone_back() -> bool:
                    node = await conn.fetchval("SELECT count(*) FROM partition_leases WHERE owner = $1 "
                                               "AND expires_at > now()", f"node-z{lost_zone}")
                    ran = await conn.fetchval("SELECT count(*) FROM runs WHERE worker_id = $1 AND started_at > $2",
                                              f"worker-z{lost_zone}", healed_at)
                    return node > 0 and ran > 0

                await wait_for(zone_back, timeout=90, what=f"zone {lost_zone}'s node and worker to work again")
                print(f"zone failover timings (s), zone {lost_zone} cut:",
                      {k: round(v, 1) for k, v in timings.items()}, flush=True)
                stop_writing.set()
                await writer
                acknowledged = [w.job_id for w in writes if w.job_id is not None]

                async def all_ran() -> bool:
                    done = await conn.fetchval("SELECT count(DISTINCT job_id) FROM runs "
                                               "WHERE job_id = ANY($1::uuid[]) AND status = 'succeeded'", acknowledged)
                    return done == len(acknowledged)

                await wait_for(all_ran, timeout=60, what=f"all {len(acknowledged)} acknowledged jobs to run")
                twice = await conn.fetch("SELECT job_id, scheduled_at FROM runs GROUP BY 1, 2 HAVING count(*) > 1")
                early = await conn.fetchval("SELECT count(*) FROM runs WHERE fired_at < scheduled_at")
            finally:
                await conn.close()
        for role in roles:
            assert role.proc.poll() is None, f"{role.name} exited:\n{role.output()[-3000:]}"
    finally:
        if writer is not None and not writer.done():
            writer.cancel()
            with contextlib.suppress(BaseException):
                await writer
        procs.stop_all()

    print(f"writes: {len(writes)}, answers {sorted({w.status for w in writes}, key=str)}", flush=True)
    assert twice == [], "a slot made two runs"
    assert early == 0, "a run fired before its slot"
    assert {w.status for w in writes} <= {201, 503}, "every write answered 201, or 503 while no primary was reachable"
    assert max(w.ended - w.started for w in writes) < REQUEST_TIMEOUT + 3
    assert timings["promotion to first delivered tick"] < 20 and timings["promotion to first accepted write"] < 30
