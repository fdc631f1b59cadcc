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

Zone 3's scheduler node and worker run on a clock 2 s ahead of the others' (libfaketime, as a zone
whose time servers are gone): no run reaches the target before its slot by the host's clock.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import httpx
import pytest
from aiohttp import web

from chimes.ha.cluster import HaCluster
from chimes.ha.runtime import HaUnavailable, etcd_binary
from chimes.ha.zones import skewed_clock
from tests.e2e.failover import REQUEST_TIMEOUT, Writer, all_acknowledged_ran_once, migrated_with_api, processes_for
from tests.e2e.processes import ChimesProcess
from tests.e2e.zones import Zones, ZonesUnavailable, check_can_make_zones
from tests.helpers import auth_as, http_server, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.long]

ZONES = 3
LEASE_TTL = 3.0
SKEWED_ZONE, SKEW_SEC = 3, 2.0  # the zone without PostgreSQL


@pytest.fixture
def zoned_cluster() -> Iterator[tuple[Zones, HaCluster]]:
    try:
        check_can_make_zones()
        etcd_binary()
        skewed_clock(SKEW_SEC)
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
    early: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        received = time.time()
        calls.append((received, request.path))
        slot = datetime.fromisoformat(request.headers["X-Chimes-Scheduled-At"]).timestamp()
        if received < slot:
            early.append(f"{request.path} {request.headers['X-Chimes-Run-Id']} arrived {slot - received:.3f} s "
                         "before its slot")
        return web.Response(text="ok")

    async with http_server(handle, zones.host_address) as target:  # reachable from every zone
        await _cut_the_primary_zone(zones, cluster, tmp_path, target, calls)
    assert early == [], "a run reached the target before its slot"


async def _cut_the_primary_zone(zones: Zones, cluster: HaCluster, tmp_path: Path, target: str,
                                calls: list[tuple[float, str]]) -> None:
    dsn = cluster.database_url()
    procs = processes_for(dsn, tmp_path)
    writer: Writer | None = None
    try:
        token, api_url, api = await migrated_with_api(procs, dsn)
        roles: list[ChimesProcess] = [api]
        for zone in range(1, ZONES + 1):
            inside = ["ip", "netns", "exec", zones.namespace(zone)]
            clock = skewed_clock(SKEW_SEC) if zone == SKEWED_ZONE else {}
            roles += [procs.start(f"node-z{zone}", "scheduler", "--node-id", f"node-z{zone}", "--lease-ttl",
                                  str(LEASE_TTL), prefix=inside, env=clock),
                      procs.start(f"worker-z{zone}", "worker", "--worker-id", f"worker-z{zone}", "--lease-sec", "5",
                                  "--shutdown-grace", "2", prefix=inside, env=clock)]
        async with httpx.AsyncClient(base_url=api_url, headers=auth_as(token),
                                     timeout=REQUEST_TIMEOUT + 15) as client:
            writer = Writer(client, target)
            await writer.api_up()
            tick = await writer.create("tick", {"cron": "* * * * * *"})
            assert tick.status_code == 201, tick.text
            await wait_for(lambda: any(path == "/tick" for _, path in calls), timeout=30, what="the first tick")
            await writer.start()

            old = await asyncio.to_thread(cluster.wait_for_primary, 30)
            lost_zone = 1 + [zones.address(z) for z in range(1, ZONES + 1)].index(old.layout.host)
            timeline = (old.state() or {}).get("timeline", 0)
            cut_at = time.time()
            zones.cut(lost_zone)
            new = await asyncio.to_thread(cluster.wait_for_primary, 120, after_timeline=timeline)
            promoted_at = time.time()
            assert new is not old
            write = await writer.accepted_after(promoted_at, "promotion")
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

            async def connected() -> asyncpg.Connection | None:
                # Right after the heal, one run of the suite found every host refusing a connection
                # for a moment; a client retries, so the test waits for one, with a deadline.
                try:
                    return await asyncpg.connect(dsn, timeout=10)
                except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
                    return None

            conn = await wait_for(connected, timeout=60, what="a primary that accepts connections after the heal",
                                  interval=0.5)
            try:
                async def zone_back() -> bool:
                    node = await conn.fetchval("SELECT count(*) FROM partition_leases WHERE owner = $1 "
                                               "AND expires_at > now()", f"node-z{lost_zone}")
                    ran = await conn.fetchval("SELECT count(*) FROM runs WHERE worker_id = $1 AND started_at > $2",
                                              f"worker-z{lost_zone}", healed_at)
                    return node > 0 and ran > 0

                await wait_for(zone_back, timeout=90, what=f"zone {lost_zone}'s node and worker to work again")
                fired_early = await conn.fetchval("SELECT count(*) FROM runs WHERE fired_at < scheduled_at")
            finally:
                await conn.close()
            print(f"zone failover timings (s), zone {lost_zone} cut:", {k: round(v, 1) for k, v in timings.items()},
                  flush=True)
            await writer.stop()
            twice = await all_acknowledged_ran_once(dsn, writer.acknowledged)
        for role in roles:
            assert role.proc.poll() is None, f"{role.name} exited:\n{role.output()[-3000:]}"
    finally:
        if writer is not None:
            await writer.stop(cancel=True)
        procs.stop_all()

    assert twice == [], "a slot made two runs"
    assert fired_early == 0, "a run fired before its slot"
    writer.check_answers()
    assert timings["promotion to first delivered tick"] < 20 and timings["promotion to first accepted write"] < 30
