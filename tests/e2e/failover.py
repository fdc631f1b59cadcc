"""A client of the API during a failover: one-off jobs created one at a time, every answer recorded.

Shared by the failover tests (tests/e2e/test_high_availability.py, test_zone_failover.py): the
client keeps writing through the outage, and the test reads from what it recorded when writes were
accepted again, what every answer was and which jobs were acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import httpx
from cryptography.fernet import Fernet

from chimes.store.tokens import create_token
from tests.e2e.processes import ChimesProcess, Processes
from tests.helpers import free_port, wait_for

REQUEST_TIMEOUT = 15.0  # the API's own (its default)


@dataclass
class Write:
    started: float  # wall clock
    ended: float
    status: int | None  # None: no answer (a transport error)
    job_id: str | None


@dataclass
class Writer:
    """Creates jobs whose task calls ``target`` (an HTTP target's URL), through ``client``."""

    client: httpx.AsyncClient
    target: str
    writes: list[Write] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    async def api_up(self) -> None:
        async def healthy() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return (await self.client.get("/healthz")).status_code == 200
            return False

        await wait_for(healthy, timeout=60, what="the API to start")

    async def create(self, name: str, schedule: dict) -> httpx.Response:
        return await self.client.post("/jobs", headers={"Idempotency-Key": str(uuid.uuid4())}, json={
            "name": name, "schedule": schedule, "concurrency": "allow",
            "task": {"type": "http", "url": f"{self.target}/{name}"}})

    async def start(self) -> None:
        """Keep creating one-off jobs due a second later, one at a time, until :meth:`stop`."""
        self._task = asyncio.create_task(self._keep_writing())
        await wait_for(lambda: len(self.writes) >= 3, timeout=20, what="the first writes")

    async def _keep_writing(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            started = time.time()
            try:
                answer = await self.create(f"once-{n}", {"at": (datetime.now(UTC) + timedelta(seconds=1)).isoformat()})
                job_id = answer.json().get("jobId") if answer.status_code == 201 else None
                self.writes.append(Write(started, time.time(), answer.status_code, job_id))
            except httpx.HTTPError:
                self.writes.append(Write(started, time.time(), None, None))
            await asyncio.sleep(0.3)  # a client's pace between writes, not a wait for a condition

    async def stop(self, *, cancel: bool = False) -> None:
        """Stop after the write in flight, or at once with ``cancel`` (a test that failed midway)."""
        self._stop.set()
        if self._task is not None:
            if cancel:
                self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def accepted_after(self, since: float, what: str) -> Write:
        return await wait_for(lambda: next((w for w in self.writes if w.status == 201 and w.started >= since), None),
                              timeout=30, what=f"a write accepted after the {what}")

    @property
    def acknowledged(self) -> list[str]:
        return [w.job_id for w in self.writes if w.job_id is not None]

    def check_answers(self) -> None:
        """Only 201, or 503 while no primary was reachable; never a hang past the API's timeout."""
        print(f"writes: {len(self.writes)}, answers {sorted({w.status for w in self.writes}, key=str)}", flush=True)
        assert {w.status for w in self.writes} <= {201, 503}, [w for w in self.writes if w.status not in (201, 503)]
        assert max(w.ended - w.started for w in self.writes) < REQUEST_TIMEOUT + 3


async def all_acknowledged_ran_once(dsn: str, acknowledged: list[str]) -> list[asyncpg.Record]:
    """Waits until every acknowledged job's run succeeded; returns the slots with more than one run."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        async def all_ran() -> bool:
            done = await conn.fetchval("SELECT count(DISTINCT job_id) FROM runs "
                                       "WHERE job_id = ANY($1::uuid[]) AND status = 'succeeded'", acknowledged)
            return done == len(acknowledged)

        await wait_for(all_ran, timeout=60, what=f"all {len(acknowledged)} acknowledged jobs to run")
        return await conn.fetch("SELECT job_id, scheduled_at FROM runs GROUP BY 1, 2 HAVING count(*) > 1")
    finally:
        await conn.close()


def processes_for(dsn: str, tmp_path: Path) -> Processes:
    procs = Processes(dsn, tmp_path)
    procs.env.update({"CHIMES_SECRET_KEY": Fernet.generate_key().decode(), "CHIMES_DATA_DIR": str(tmp_path / "d")})
    return procs


async def migrated_with_api(procs: Processes, dsn: str) -> tuple[str, str, ChimesProcess]:
    """Migrate the database, make a team's token, start the API on 127.0.0.1: (token, its URL, the API)."""
    migrate = procs.start("migrate", "migrate")
    assert await migrate.exited(60) == 0, migrate.output()
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        token = await create_token(conn, "team", admin=False)
    finally:
        await conn.close()
    port = free_port()
    api = procs.start("api", "api", "--host", "127.0.0.1", "--port", str(port))
    return token, f"http://127.0.0.1:{port}", api
