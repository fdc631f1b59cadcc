"""Requests that meet a partition being moved, or moved a moment ago (docs/scaling.md, "Moving
partitions").

A job's database refuses a write to a partition it is giving away, or has given away (SQLSTATE CH001:
the move's fence, or the catalog's). The request changed nothing, so it can be made again: this
middleware reads the shard map again and replays the request (its body is kept) until the write
lands where the job lives, for up to ``seconds``: a move's cut-over is a pause for the writer, not an
error. Past that, 503 ``partition_moving`` with Retry-After.

Reads are not fenced, and the source deletes its copies once the range is cut over: a process still
on the old map (it reads the map every second) would answer 404 for a job that only moved. A 404 is
therefore held back while the map's version is read again (one primary-key read): when the map
changed, the request is made again on the new one; when not, the 404 is what it said. Nothing
changed for it: a 404 is an answer about a job or run its database does not have.
"""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chimes.api import homes, standby
from chimes.api.errors import error_body
from chimes.api.responses import JSONResponse
from chimes.store.shards import ShardPools, partition_moved

log = logging.getLogger(__name__)

NOT_FOUND = 404


class ReplayMovedRequests:
    def __init__(self, app: ASGIApp, seconds: float = 10.0, pause_sec: float = 0.05) -> None:
        self.app, self.seconds, self.pause_sec = app, seconds, pause_sec

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        shards: ShardPools = scope["app"].state.shards
        # Served from a standby, or while the primary fails, the catalog's map cannot be read again: a
        # 404 then goes out at once, not after the primary's timeout.
        hold = not standby.scope_from_standby(scope) and not standby.primary_failing()
        body = _Body(receive)
        deadline = time.monotonic() + self.seconds
        while True:
            response = _HeldNotFound(send, hold=hold)
            try:
                await self.app(scope, body.replay(), response.send)
            except Exception as exc:
                if response.started or not partition_moved(exc):
                    raise
                log.info("%s %s: the job's partition is moving; reading the shard map again",
                         scope["method"], scope["path"])
            else:
                if not response.held or not await homes.read_map_again(shards):
                    await response.release()
                    return
                log.info("%s %s: not found on the old shard map; made again on the new one",
                         scope["method"], scope["path"])
                continue
            await shards.refresh()
            if time.monotonic() > deadline:
                refused = JSONResponse(
                    error_body("partition_moving", f"the job's partitions are being moved to another database and "
                               f"the move had not cut over after {self.seconds:g} s; nothing was changed: retry"),
                    503, headers={"Retry-After": "1"})
                await refused(scope, receive, send)
                return
            await asyncio.sleep(self.pause_sec)


class _HeldNotFound:
    """Passes a response through, except a 404 while ``hold``: kept until :meth:`release`."""

    def __init__(self, send: Send, *, hold: bool) -> None:
        self._send, self._hold = send, hold
        self.started = False
        self.held: list[Message] = []

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            if self._hold and message["status"] == NOT_FOUND:
                self.held.append(message)
                return
        elif self.held:
            self.held.append(message)
            return
        await self._send(message)

    async def release(self) -> None:
        for message in self.held:
            await self._send(message)


class _Body:
    """The request's body, read from the client once, when the app first asks for it, and given again
    to each replay. Not read before: a request whose app never reads its body (a GET) leaves it to
    whoever calls this middleware again with the same ``receive`` (StandbyReads does, from the
    standby), which would otherwise wait for a body already taken."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._body: bytes | None = None

    def replay(self) -> Receive:
        sent = False

        async def replayed() -> Message:
            nonlocal sent
            if sent:
                return await self._receive()  # after the body: the client's disconnect, when it comes
            sent = True
            if self._body is None:
                self._body = await _whole_body(self._receive)
            return {"type": "http.request", "body": self._body, "more_body": False}

        return replayed


async def _whole_body(receive: Receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(parts)
