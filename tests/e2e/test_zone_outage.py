"""Losing the primary's zone (issue 20): the rest of the fleet carries on within seconds of the promotion.

Two zones in network namespaces on a bridge: zone 1 holds the PostgreSQL primary, a scheduler node
and a worker; zone 2 a synchronous streaming standby. The API, a second scheduler node and a second
worker run on the host side of the bridge and reach both servers through a two-host database URL
with ``target_session_attrs=read-write``; the HTTP target listens on the bridge address.

Zone 1 is cut off (packets dropped, no resets), the standby promoted once the primary has not
answered for a few seconds, as a failover manager does, and the old primary stopped. Then: writes
are accepted again within 30 s of the promotion and no request hangs past the API's own timeout
(503 with Retry-After instead); fires and deliveries resume within 20 s; every job the API
acknowledged runs; one run per slot; after the link heals, zone 1's node and worker are back
without a restart; every failure the roles logged names its cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import httpx
import pytest
from aiohttp import web
from cryptography.fernet import Fernet

from chimes.store.tokens import create_token
from tests.e2e.processes import ChimesProcess, Processes
from tests.e2e.zones import PG_PORT, ZonePostgres, Zones, ZonesUnavailable, check_can_make_zones, server_root
from tests.helpers import auth_as, free_port, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.long]

REQUEST_TIMEOUT = 15.0  # the API's own (its default)
LEASE_TTL = 3.0


@dataclass
class Probe:
    started: float  # wall clock
    ended: float
    status: int | None  # None: no answer (the client gave up) or a transport error
    job_id: str | None
    retry_after: str | None
    error: str | None = None


class Target:
    """An HTTP target on the bridge address, reachable from the host and every zone."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, str, str]] = []  # (received at, path, run id)
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self, host: str) -> None:
        async def handle(request: web.Request) -> web.Response:
            self.calls.append((time.time(), request.path, request.headers.get("X-Chimes-Run-Id", "")))
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, host, port).start()
        self.url = f"http://{host}:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def primary_answers(address: str) -> bool:
    """A failover manager's health check: does the primary accept a TCP connection within a second?"""
    try:
        with socket.create_connection((address, PG_PORT), timeout=1.0):
            return True
    except OSError:
        return False


def failures_without_cause(log: str) -> list[str]:
    """Warning and error lines whose message ends where the cause should be (``failed: ``)."""
    bad = []
    for line in log.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("level") not in ("WARNING", "ERROR", "CRITICAL"):
            continue
        message = str(entry.get("message", "")).rstrip()
        if message.endswith(":") or "()" in message or ": ;" in message or ": )" in message:
            bad.append(message)
    return bad


@pytest.fixture
def zones() -> Iterator[Zones]:
    try:
        check_can_make_zones()
    except ZonesUnavailable as exc:
        pytest.skip(f"cannot make network namespaces here: {exc}")
    made = Zones(2)
    try:
        made.make()
        yield made
    finally:
        left = made.remove()
        assert not left, f"could not remove {left}"


@pytest.mark.timeout(360)
async def test_losing_the_primary_zone_stalls_nothing_for_long(zones: Zones, tmp_path: Path) -> None:
    root = server_root()
    began = time.monotonic()

    def stage(what: str) -> None:
        print(f"[{time.monotonic() - began:6.1f} s] {what}", flush=True)
    primary, standby = ZonePostgres(zones, 1, root), ZonePostgres(zones, 2, root)
    target = Target()
    procs: Processes | None = None
    prober: asyncio.Task[None] | None = None
    try:
        # The primary in zone 1, a synchronous standby in zone 2.
        primary.init_primary()
        primary.start()
        admin_dsn = f"postgresql://postgres@{primary.address}:{PG_PORT}/postgres"
        conn = await asyncpg.connect(admin_dsn, timeout=10)
        await conn.execute("CREATE DATABASE chimes")
        await conn.close()
        dsn = (f"postgresql://postgres@{primary.address}:{PG_PORT},{standby.address}:{PG_PORT}/chimes"
               "?target_session_attrs=read-write")
        procs = Processes(dsn, tmp_path)
        procs.env.update({"CHIMES_SECRET_KEY": Fernet.generate_key().decode(), "CHIMES_LOG_FORMAT": "json",
                          "CHIMES_DATA_DIR": str(tmp_path / "data")})
        migrate = procs.start("migrate", "migrate")
        assert await migrate.exited(60) == 0, migrate.output()
        stage('primary up, migrated')
        standby.init_standby_of(primary)
        standby.start()
        conn = await asyncpg.connect(admin_dsn, timeout=10)
        await conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
        await conn.execute("SELECT pg_reload_conf()")
        await wait_for(lambda: conn.fetchval("SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"),
                       timeout=30, what="the standby to replicate synchronously")
        await conn.close()
        conn = await asyncpg.connect(dsn, timeout=10)
        token = await create_token(conn, "team", admin=False)
        await conn.close()

        stage('standby synchronous')
        await target.start(zones.host_address)
        in_zone_1 = ["ip", "netns", "exec", zones.namespace(1)]
        api_port = free_port()
        api = procs.start("api", "api", "--host", "127.0.0.1", "--port", str(api_port))
        roles: list[ChimesProcess] = [
            api,
            procs.start("node-host", "scheduler", "--node-id", "node-host", "--lease-ttl", str(LEASE_TTL)),
            procs.start("worker-host", "worker", "--worker-id", "worker-host", "--lease-sec", "5",
                        "--shutdown-grace", "2"),
            procs.start("node-z1", "scheduler", "--node-id", "node-z1", "--lease-ttl", str(LEASE_TTL),
                        prefix=in_zone_1),
            procs.start("worker-z1", "worker", "--worker-id", "worker-z1", "--lease-sec", "5",
                        "--shutdown-grace", "2", prefix=in_zone_1),
        ]

        base = f"http://127.0.0.1:{api_port}"
        async with httpx.AsyncClient(base_url=base, headers=auth_as(token), timeout=REQUEST_TIMEOUT + 15) as client:
            async def healthy() -> bool:
                with contextlib.suppress(httpx.HTTPError):
                    return (await client.get("/healthz")).status_code == 200
                return False

            await wait_for(healthy, timeout=60, what="the API to start")
            db = await asyncpg.connect(dsn, timeout=10)

            async def fleet_up() -> bool:
                owners = {r["owner"] for r in await db.fetch(
                    "SELECT DISTINCT owner FROM partition_leases WHERE expires_at > now()")}
                workers = {r["worker_id"] for r in await db.fetch("SELECT worker_id FROM workers")}
                return {"node-host", "node-z1"} <= owners and {"worker-host", "worker-z1"} <= workers

            await wait_for(fleet_up, timeout=60, what="both nodes to hold partitions and both workers to register")
            await db.close()

            async def create(name: str, schedule: dict, key: str | None = None) -> httpx.Response:
                headers = {"Idempotency-Key": key} if key else {}
                return await client.post("/jobs", headers=headers, json={
                    "name": name, "schedule": schedule, "concurrency": "allow",
                    "task": {"type": "http", "url": f"{target.url}/{name}"}})

            stage('fleet up')
            tick = await create("tick", {"cron": "* * * * * *"})
            assert tick.status_code == 201, tick.text
            tick_id = tick.json()["jobId"]
            await wait_for(lambda: any(path == "/tick" for _, path, _ in target.calls), timeout=20,
                           what="the first delivery of the every-second job")

            # One-off jobs due while zone 1 is gone, acknowledged before it goes.
            acknowledged: list[str] = []
            for i in range(10):
                at = (datetime.now(UTC) + timedelta(seconds=2 + i)).isoformat()
                response = await create(f"before-{i}", {"at": at})
                assert response.status_code == 201, response.text
                acknowledged.append(response.json()["jobId"])

            # Writes all along: one at a time, each a one-off job due a second later.
            probes: list[Probe] = []
            probing = asyncio.Event()

            async def probe_writes() -> None:
                n = 0
                while not probing.is_set():
                    n += 1
                    at = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
                    started = time.time()
                    try:
                        response = await create(f"probe-{n}", {"at": at}, key=str(uuid.uuid4()))
                        job_id = response.json().get("jobId") if response.status_code == 201 else None
                        probes.append(Probe(started, time.time(), response.status_code, job_id,
                                            response.headers.get("Retry-After")))
                    except httpx.HTTPError as exc:
                        probes.append(Probe(started, time.time(), None, None, None, repr(exc)))
                    await asyncio.sleep(0.5)  # a client's pace between writes, not a wait for a condition

            prober = asyncio.create_task(probe_writes())
            await wait_for(lambda: len(probes) >= 3, timeout=20, what="the first writes")

            # Zone 1 vanishes. The failover manager promotes the standby once the primary has not
            # answered for 3 s, and stops the old primary (it cannot reach it: a local signal in zone 1).
            stage('cutting zone 1')
            cut_at = time.time()
            zones.cut(1)
            unanswered_since: list[float] = []

            def primary_gone_for_3s() -> bool:
                if primary_answers(primary.address):
                    unanswered_since.clear()
                elif not unanswered_since:
                    unanswered_since.append(time.monotonic())
                return bool(unanswered_since) and time.monotonic() - unanswered_since[0] >= 3

            await wait_for(primary_gone_for_3s, timeout=20, what="the primary to stop answering", interval=0.5)
            # /healthz says what is wrong, without naming hosts: no primary, one standby, one host silent.
            health = await client.get("/healthz")
            assert health.status_code == 503, health.text
            assert health.headers["Retry-After"].isdigit()
            assert health.json()["hosts"] == {"standby": 1, "not answering": 1}, health.json()
            assert health.json()["error"].startswith("no primary among the 2 hosts of the database URL"), health.json()
            assert datetime.fromisoformat(health.json()["since"]).timestamp() >= cut_at - 1
            assert primary.address not in health.text and standby.address not in health.text
            # Reads go on, from the standby, and say so; writes answer 503 (the probes above).
            read = await client.get(f"/jobs/{tick_id}")
            assert read.status_code == 200, read.text
            assert read.headers["X-Chimes-Read-From"] == "standby" and read.json()["jobId"] == tick_id
            history = await client.get(f"/jobs/{tick_id}/runs", params={"limit": 5})
            assert history.status_code == 200 and history.headers["X-Chimes-Read-From"] == "standby", history.text
            assert history.json()["runs"] and {r["jobId"] for r in history.json()["runs"]} == {tick_id}
            # So do the dashboard's pages, which say where they were read from.
            page = await client.get(f"/ui/jobs/{tick_id}", headers={"Cookie": f"chimes_session={token}"})
            assert page.status_code == 200 and page.headers["X-Chimes-Read-From"] == "standby", page.text[:500]
            assert 'id="read-from-standby"' in page.text and tick_id in page.text
            stage('promoting')
            standby.promote()
            promoted_at = time.time()
            primary.stop()

            def first_write_after_promotion() -> Probe | None:
                return next((p for p in probes if p.status == 201 and p.started >= promoted_at), None)

            first_write = await wait_for(first_write_after_promotion, timeout=35,
                                         what="a write accepted after the promotion")
            new_primary = await asyncpg.connect(f"postgresql://postgres@{standby.address}:{PG_PORT}/chimes",
                                                timeout=10)

            async def first_fire_after_promotion() -> datetime | None:
                return await new_primary.fetchval(
                    "SELECT min(fired_at) FROM runs WHERE fired_at > $1",
                    datetime.fromtimestamp(promoted_at, UTC))

            def first_delivery_after_promotion() -> float | None:
                return min((at for at, _, _ in target.calls if at > promoted_at), default=None)

            first_fire = await wait_for(first_fire_after_promotion, timeout=25, what="a fire after the promotion")
            first_delivery = await wait_for(first_delivery_after_promotion, timeout=25,
                                            what="a delivery after the promotion")
            timings = {
                "cut to promotion": promoted_at - cut_at,
                "promotion to first accepted write": first_write.ended - promoted_at,
                "promotion to first fire": first_fire.timestamp() - promoted_at,
                "promotion to first delivery": first_delivery - promoted_at,
            }
            print("zone outage timings (s):", {k: round(v, 1) for k, v in timings.items()}, flush=True)

            # Zone 1 comes back: its node and worker rejoin without a restart.
            stage('healing')
            zones.heal(1)
            healed_at = datetime.now(UTC)

            async def zone_1_back() -> bool:
                node = await new_primary.fetchval(
                    "SELECT count(*) FROM partition_leases WHERE owner = 'node-z1' AND expires_at > now()")
                ran = await new_primary.fetchval(
                    "SELECT count(*) FROM runs WHERE worker_id = 'worker-z1' AND started_at > $1", healed_at)
                return node > 0 and ran > 0

            await wait_for(zone_1_back, timeout=90, what="zone 1's node to hold partitions and its worker to run")

            stage('zone 1 back')
            probing.set()
            await prober
            acknowledged += [p.job_id for p in probes if p.job_id is not None]

            async def all_ran() -> bool:
                done = await new_primary.fetchval(
                    "SELECT count(DISTINCT job_id) FROM runs WHERE job_id = ANY($1::uuid[]) AND status = 'succeeded'",
                    acknowledged)
                return done == len(acknowledged)

            try:
                await wait_for(all_ran, timeout=60, what=f"all {len(acknowledged)} acknowledged jobs to run")
            except AssertionError as exc:
                not_done = await new_primary.fetch(
                    "SELECT j.name, r.status, r.attempt, r.worker_id, r.scheduled_at, r.started_at, r.error"
                    " FROM jobs j LEFT JOIN runs r ON r.job_id = j.job_id WHERE j.job_id = ANY($1::uuid[])"
                    " AND NOT EXISTS (SELECT FROM runs s WHERE s.job_id = j.job_id AND s.status = 'succeeded')"
                    " ORDER BY j.name, r.attempt", acknowledged)
                raise AssertionError(f"{exc}; not run: {[dict(row) for row in not_done]}") from None
            stage('all acknowledged ran')
            twice = await new_primary.fetch(
                "SELECT job_id, scheduled_at, count(*) AS n FROM runs GROUP BY 1, 2 HAVING count(*) > 1")
            tick_runs = await new_primary.fetchval("SELECT count(*) FROM runs WHERE job_id = $1", uuid.UUID(tick_id))
            await new_primary.close()
            for process in roles:  # every role lived through it: none exited
                assert process.proc.poll() is None, f"{process.name} exited:\n{process.output()[-3000:]}"
    finally:
        stage("stopping")
        if prober is not None and not prober.done():  # the test failed midway
            prober.cancel()
            with contextlib.suppress(BaseException):
                await prober
        if procs is not None:
            procs.stop_all()
        stage("stopped roles")
        await target.stop()
        with contextlib.suppress(Exception):
            primary.stop()
        with contextlib.suppress(Exception):
            standby.stop()
        shutil.rmtree(root, ignore_errors=True)

    answered = sorted({p.status for p in probes}, key=str)
    print(f"writes: {len(probes)}, answers {answered}, 503s {sum(p.status == 503 for p in probes)}, "
          f"longest {max(p.ended - p.started for p in probes):.1f} s", flush=True)
    try:
        assert not twice, f"slots with more than one run: {twice}"
        assert tick_runs > 0
        slow = [p for p in probes if p.ended - p.started > REQUEST_TIMEOUT + 3]
        assert not slow, f"requests that hung past the API's timeout: {slow}"
        assert {p.status for p in probes} <= {201, 503}, [p for p in probes if p.status not in (201, 503)]
        assert all(p.retry_after for p in probes if p.status == 503)
        assert timings["promotion to first accepted write"] <= 30, timings
        assert timings["promotion to first fire"] <= 20, timings
        assert timings["promotion to first delivery"] <= 20, timings
        logs = {p.name: p.log_path.read_text(errors="replace") for p in roles}
        for name, log in logs.items():
            assert not failures_without_cause(log), f"{name} logged failures without a cause: " \
                                                    f"{failures_without_cause(log)[:5]}"
        assert any("Error" in line and '"WARNING"' in line for log in logs.values() for line in log.splitlines())
    finally:
        if os.environ.get("CHIMES_KEEP_ZONE_LOGS"):
            print(f"logs in {tmp_path}")
