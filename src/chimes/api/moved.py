"""Writes that meet a partition being moved (docs/scaling.md, "Moving partitions").

A job's database refuses a write to a partition it is giving away, or has given away (SQLSTATE CH001:
the move's fence, or the catalog's). The request changed nothing, so it can be made again: this
middleware reads the shard map again and replays the request (its body is kept) until the write
lands where the job lives, for up to ``seconds``: a move's cut-over is a pause for the writer, not an
error. Past that, 503 ``partition_moving`` with Retry-After.
"""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chimes.api.errors import error_body
from chimes.api.responses import JSONResponse
from chimes.store.shards import partition_moved

log = logging.getLogger(__name__)

READS = frozenset({"GET", "HEAD", "OPTIONS"})


class ReplayMovedWrites:
    def __init__(self, app: ASGIApp, seconds: float = 10.0, pause_sec: float = 0.05) -> None:
        self.app, self.seconds, self.pause_sec = app, seconds, pause_sec

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in READS:
            await self.app(scope, receive, send)
            return
        body = await _whole_body(receive)
        deadline = time.monotonic() + self.seconds
        while True:
            started = False

            async def noting_start(message: Message) -> None:
                nonlocal started
                started = started or message["type"] == "http.response.start"
                await send(message)

            try:
                await self.app(scope, _replay(body, receive), noting_start)
                return
            except Exception as exc:
                if started or not partition_moved(exc):
                    raise
                log.info("%s %s: the job's partition is moving; reading the shard map again",
                         scope["method"], scope["path"])
            await scope["app"].state.shards.refresh()
            if time.monotonic() > deadline:
                response = JSONResponse(
                    error_body("partition_moving", f"the job's partitions are being moved to another database and "
                               f"the move had not cut over after {self.seconds:g} s; nothing was changed: retry"),
                    503, headers={"Retry-After": "1"})
                await response(scope, receive, send)
                return
            await asyncio.sleep(self.pause_sec)


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


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the client's disconnect, when it comes

    return replayed
