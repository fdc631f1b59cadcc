"""A client of the Chimes API through a failover: one-off jobs created, every answer recorded.

Shared by the high-availability benchmarks (bench/ha_cost.py, bench/async_loss.py) and the failover
tests (tests/e2e/failover.py): the writer keeps creating jobs through an outage, and the caller
reads from what it recorded when writes were accepted again, what every answer was, and which jobs
were acknowledged (answered 201). Also the API as a process of its own, and a token for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from bench.procs import Proc, free_port, python
from chimes.store.tokens import create_token

REQUEST_TIMEOUT = 15.0  # the API's own (its default)


async def wait_until(condition: Callable[[], Any], *, limit_sec: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``condition`` (sync or async) until it returns something truthy; TimeoutError after ``limit_sec``."""
    deadline = time.monotonic() + limit_sec
    while True:
        result = condition()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {limit_sec:g} s waiting for {what}")
        await asyncio.sleep(interval)


@dataclass
class Write:
    started: float  # wall clock
    ended: float
    status: int | None  # None: no answer (a transport error)
    job_id: str | None


@dataclass
class Writer:
    """Creates one-off jobs due ``due_in`` seconds later whose task calls ``target/NAME`` (an HTTP
    target's URL), through ``client``: ``lanes`` writers at once, each waiting ``pace`` seconds
    between its writes (0: as fast as the API answers)."""

    client: httpx.AsyncClient
    target: str
    pace: float = 0.3
    lanes: int = 1
    prefix: str = "once"  # of the job names, NAME = PREFIX-N
    due_in: float = 1.0
    writes: list[Write] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _numbers: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    async def api_up(self) -> None:
        async def healthy() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return (await self.client.get("/healthz")).status_code == 200
            return False

        await wait_until(healthy, limit_sec=60, what="the API to start")

    async def create(self, name: str, schedule: dict) -> httpx.Response:
        return await self.client.post("/jobs", headers={"Idempotency-Key": str(uuid.uuid4())}, json={
            "name": name, "schedule": schedule, "concurrency": "allow",
            "task": {"type": "http", "url": f"{self.target}/{name}"}})

    async def start(self, first: int = 3) -> None:
        """Keep creating jobs until :meth:`stop`; returns once ``first`` writes were answered."""
        self._tasks = [asyncio.create_task(self._keep_writing()) for _ in range(self.lanes)]
        await wait_until(lambda: len(self.writes) >= first, limit_sec=20 + first / 10, what="the first writes")

    async def _keep_writing(self) -> None:
        while not self._stop.is_set():
            name = f"{self.prefix}-{next(self._numbers)}"
            started = time.time()
            try:
                due = datetime.now(UTC) + timedelta(seconds=self.due_in)
                answer = await self.create(name, {"at": due.isoformat()})
                job_id = answer.json().get("jobId") if answer.status_code == 201 else None
                self.writes.append(Write(started, time.time(), answer.status_code, job_id))
            except httpx.HTTPError:
                self.writes.append(Write(started, time.time(), None, None))
            if self.pace:
                await asyncio.sleep(self.pace)  # a client's pace between writes, not a wait for a condition

    async def stop(self, *, cancel: bool = False) -> None:
        """Stop after the writes in flight, or at once with ``cancel`` (a caller that failed midway)."""
        self._stop.set()
        for task in self._tasks:
            if cancel:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def accepted_after(self, since: float, what: str, limit_sec: float = 30) -> Write:
        return await wait_until(
            lambda: next((w for w in self.writes if w.status == 201 and w.started >= since), None),
            limit_sec=limit_sec, what=f"a write accepted after the {what}")

    @property
    def acknowledged(self) -> list[str]:
        return [w.job_id for w in self.writes if w.job_id is not None]


async def team_token(dsn: str, owner: str = "team") -> str:
    """A write token for ``owner`` (not an admin: the API's usual caller)."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        return await create_token(conn, owner, admin=False)
    finally:
        await conn.close()


class ApiProcess:
    """``chimes api`` on 127.0.0.1 as a :class:`Proc` (its CPU and memory can be measured). Start it
    after the fleet is ready, or before the fleet starts: the first process makes the key file."""

    def __init__(self, dsn: str, workdir: Path, name: str = "api") -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rsplit(":", 1)[1]
        # The key file in the same data folder as the fleet's (bench/chimes_runs.py): one secret key
        env = {"CHIMES_DATABASE_URL": dsn, "CHIMES_DATA_DIR": str(workdir / "chimes"), "CHIMES_LOG_FORMAT": "json"}
        self.proc = Proc(name, python("-m", "chimes", "api", "--host", "127.0.0.1", "--port", port),
                         workdir / f"{name}.log", env)

    async def ready(self, client: httpx.AsyncClient) -> None:
        """``GET /healthz`` answers 200 through ``client`` (whose base URL is :attr:`url`)."""
        async def healthy() -> bool:
            if not self.proc.alive():
                raise RuntimeError(f"the API exited:\n{self.proc.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                return (await client.get("/healthz")).status_code == 200
            return False

        await wait_until(healthy, limit_sec=60, what="the API to start", interval=0.2)

    def stop(self) -> None:
        self.proc.stop()
