"""Starlette and FastAPI: a verified :class:`~chimes.receiver.ChimesCall` from a request.

In FastAPI, ``chimes_call(receiver)`` is a dependency (``call: ChimesCall = Depends(get_call)``); in
Starlette, await it with the request. A request that is not a valid call from Chimes ends in an
``HTTPException`` with 401 (bad or stale signature) or 400, which both frameworks answer as JSON
``{"detail": ...}``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from starlette.exceptions import HTTPException
from starlette.requests import Request

from chimes.receiver.calls import CallRejected, ChimesCall
from chimes.receiver.receiver import Receiver

__all__ = ["chimes_call"]

log = logging.getLogger("chimes.receiver")


def chimes_call(receiver: Receiver) -> Callable[[Request], Awaitable[ChimesCall]]:
    """A function of the request that returns the verified call, or raises ``HTTPException``."""

    async def verified(request: Request) -> ChimesCall:
        body = await request.body()  # the raw bytes, as signed; the framework caches them for the handler
        try:
            return receiver.verify(request.headers, body)
        except CallRejected as exc:
            client = request.client.host if request.client else "?"
            log.warning("refused a call from %s to %s: %s", client, request.url.path, exc.reason)
            raise HTTPException(exc.status, exc.reason) from None

    return verified
