"""aiohttp: a verified :class:`~chimes.receiver.ChimesCall` from a request.

``await chimes_call(receiver, request)`` in a handler returns the call, or raises
``web.HTTPUnauthorized`` (bad or stale signature) or ``web.HTTPBadRequest``, which aiohttp answers.
"""

from __future__ import annotations

import logging

from aiohttp import web

from chimes.receiver.calls import CallRejected, ChimesCall
from chimes.receiver.receiver import Receiver

__all__ = ["chimes_call"]

log = logging.getLogger("chimes.receiver")


async def chimes_call(receiver: Receiver, request: web.Request) -> ChimesCall:
    """The verified call of ``request`` (its raw body is read; ``request.read()`` returns it again)."""
    body = await request.read()
    try:
        return receiver.verify(request.headers, body)
    except CallRejected as exc:
        log.warning("refused a call from %s to %s: %s", request.remote, request.path, exc.reason)
        error = web.HTTPUnauthorized if exc.status == 401 else web.HTTPBadRequest
        raise error(text=exc.reason) from None
