"""Reads from a standby while no primary is reachable: a failover should not blind the people and
the tools watching their jobs.

While the API cannot reach a primary, a ``GET`` of the REST API (jobs, runs, notifications, the
queue, whoami) or of a dashboard page that would answer 503 is answered instead from any server of
the database URL that takes connections, in practice the standby about to be promoted; the dashboard
says so on the page. Only reads are served so: writes
still answer 503 with Retry-After. What a standby has may lag the primary by the transactions it has
not replayed yet (with synchronous replication it has every commit that was acknowledged, written
if not always replayed), so such answers carry ``X-Chimes-Read-From: standby`` and are not to be
cached. While the outage goes on (a failure in the last few seconds), reads go to the standby at
once rather than waiting for the primary's timeouts each time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chimes import outage
from chimes.services.jobs import JobService
from chimes.store import db
from chimes.store.runs import RunStore

log = logging.getLogger(__name__)

READ_PATHS = ("/jobs", "/runs/", "/notifications", "/queue", "/whoami", "/ui/")  # /ui/: the dashboard's pages
STRAIGHT_TO_STANDBY_SEC = 5.0  # after a failure this recent, reads skip the primary
POOL_SIZE = 4


class Standby:
    """Stores over a pool of connections to whichever server answers, opened at first need."""

    def __init__(self, dsn: str, job_store: Callable[[Any], JobService]) -> None:
        self.dsn = db.any_server(dsn)
        self._job_store = job_store
        self._opening = asyncio.Lock()
        self.pool: Any = None
        self.jobs: JobService | None = None
        self.runs: RunStore | None = None

    async def open(self) -> bool:
        async with self._opening:
            if self.pool is None:
                try:
                    self.pool = await db.create_pool(self.dsn, min_size=0, max_size=POOL_SIZE, wait_sec=0,
                                                      command_timeout=db.command_timeout(db.ROLE_COMMAND_TIMEOUT_SEC))
                except db.UNAVAILABLE_ERRORS as exc:
                    log.warning("no server to read from either: %s", db.describe(exc))
                    return False
                self.jobs = self._job_store(self.pool)
                self.runs = RunStore(self.pool)
        return True

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()


def reading_from_standby(request: Request) -> bool:
    return scope_from_standby(request.scope)


def scope_from_standby(scope: Scope) -> bool:
    """Whether the request of ``scope`` is served from the standby (StandbyReads marks it so)."""
    return bool(scope.get("state", {}).get("standby"))


def pool(request: Request) -> Any:
    """The pool a handler reads through: the standby's while this request is served from it."""
    return request.app.state.standby.pool if reading_from_standby(request) else request.app.state.pool


def jobs(request: Request) -> JobService:
    store: JobService = request.app.state.standby.jobs if reading_from_standby(request) else request.app.state.jobs
    return store


def runs(request: Request) -> RunStore:
    store: RunStore = request.app.state.standby.runs if reading_from_standby(request) else request.app.state.runs
    return store


def primary_failing() -> bool:
    """Whether this process failed to reach a primary in the last few seconds: reads then go to the
    standby at once, and nothing else waits on the primary that it can do without."""
    now = time.monotonic()
    return any(now - each.last_failure < STRAIGHT_TO_STANDBY_SEC for each in outage.going_on())


class StandbyReads:
    """ASGI middleware: a read that meets an unreachable primary is answered from the standby."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("GET", "HEAD") or not scope["path"].startswith(
                READ_PATHS):
            await self.app(scope, receive, send)
            return
        if primary_failing():
            if await self._from_standby(scope, receive, send):
                return
        held: list[Message] = []

        async def hold_a_503(message: Message) -> None:
            if held or (message["type"] == "http.response.start" and message["status"] == 503):
                held.append(message)  # the primary is unreachable: answer from the standby instead
            else:
                await send(message)

        await self.app(scope, receive, hold_a_503)
        if held and not await self._from_standby(scope, receive, send):
            for message in held:
                await send(message)

    async def _from_standby(self, scope: Scope, receive: Receive, send: Send) -> bool:
        standby: Standby = scope["app"].state.standby
        if not await standby.open():
            return False
        answered: list[int] = []

        async def marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                answered.append(message["status"])
                if message["status"] == 503:
                    return  # the standby is gone too: the caller sends the primary's 503
                message["headers"] = [*message.get("headers", []), (b"x-chimes-read-from", b"standby"),
                                      (b"cache-control", b"no-store")]
            elif answered and answered[0] == 503:
                return
            await send(message)

        state = dict(scope.get("state") or {})
        state["standby"] = True
        await self.app({**scope, "state": state}, receive, marked)
        return bool(answered) and answered[0] != 503
