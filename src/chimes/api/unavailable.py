"""While the database cannot be reached, the API answers at once: 503 with Retry-After, never a hang
and never a 500.

Two ways a request meets an unreachable database: an error (connection refused or lost, a statement
timed out, no host of the URL is the primary yet), answered by :func:`install`'s handler; or no
answer at all (a host that vanished without a reset), answered by :class:`RequestDeadline` when the
request's own timeout passes. The request is left to end in the background: its connection is
given back to the pool once asyncpg has cancelled the statement or dropped the connection, which
the database timeouts bound (``chimes.store.db.Timeouts``).
"""

from __future__ import annotations

import asyncio
import logging
import math

from fastapi import FastAPI, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chimes import outage
from chimes.api.errors import error_body
from chimes.api.responses import JSONResponse
from chimes.store.db import UNAVAILABLE_ERRORS, describe

log = logging.getLogger(__name__)

RETRY_AFTER_SEC = 2


def unavailable(message: str, retry_after: float = RETRY_AFTER_SEC) -> JSONResponse:
    seconds = max(1, math.ceil(retry_after))
    return JSONResponse(error_body("database_unavailable", f"{message}; retry after {seconds} s"), 503,
                        headers={"Retry-After": str(seconds)})


def install(app: FastAPI) -> None:
    async def _unreachable(request: Request, exc: Exception) -> JSONResponse:
        database = outage.database_of(exc)
        outage.failed(f"{request.method} {request.url.path}", describe(exc), database)  # logged once per outage
        # Its role only ("catalog", "shard 2"): the answer may go to a client without a token, and hosts
        # are for the log.
        which = f" ({database.role})" if database.role else ""
        return unavailable(f"the database{which} is unavailable now (a restart or a failover); nothing was changed")

    for error in UNAVAILABLE_ERRORS:
        app.add_exception_handler(error, _unreachable)


class RequestDeadline:
    """Answer 503 when a request has not started its response within ``seconds``. The handler goes
    on in the background (a write it was making may still commit: retry with the same
    ``Idempotency-Key``), and whatever it sends later is dropped."""

    def __init__(self, app: ASGIApp, seconds: float) -> None:
        self.app, self.seconds = app, seconds
        self._left_behind: set[asyncio.Task[None]] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = answered = False

        async def send_unless_answered(message: Message) -> None:
            nonlocal started
            if answered:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        task = asyncio.ensure_future(self.app(scope, receive, send_unless_answered))
        done, _ = await asyncio.wait({task}, timeout=self.seconds)
        if done or started:  # finished, or a response under way (it is not cut off midway)
            await task
            return
        answered = True
        task.cancel()
        self._left_behind.add(task)
        task.add_done_callback(self._forget)
        log.warning("%s %s: no answer within %g s (the database is slow or unreachable); answered 503",
                    scope.get("method"), scope.get("path"), self.seconds)
        response = unavailable(f"no answer from the database within {self.seconds:g} s; the request may or may "
                               "not have taken effect (retry writes with the same Idempotency-Key)")
        await response(scope, receive, send)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._left_behind.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a request answered 503 ended with %s", describe(task.exception()))  # type: ignore[arg-type]
