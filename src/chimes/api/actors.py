"""Who is calling, for the audit trail: the request id and the note that state-changing endpoints
hand to :func:`chimes.store.audit.record`.

Every request gets an id: the caller's ``X-Request-Id`` when it is a short plain token (a proxy's),
else a new one; it is echoed in the response's ``X-Request-Id`` and kept on the audit entries the
request wrote, so an entry leads back to the proxy's and the API's logs.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chimes.api.clock import clock_of
from chimes.store.audit import Actor, AuditNote
from chimes.store.tokens import Principal

REQUEST_ID_HEADER = "x-request-id"
_GIVEN_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,100}")


def request_id_of(scope: Scope) -> str:
    state: dict[str, Any] = scope.setdefault("state", {})
    if "request_id" not in state:
        given = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == REQUEST_ID_HEADER.encode()),
                     "")
        state["request_id"] = given if _GIVEN_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
    request_id: str = state["request_id"]
    return request_id


class RequestIds:
    """ASGI middleware: every HTTP request has an id (see the module docstring), echoed in the answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope).encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (REQUEST_ID_HEADER.encode(), request_id)]
            await send(message)

        await self.app(scope, receive, send_with_id)


def note_of(request: Request, caller: Principal) -> AuditNote:
    """Who is changing something with this request, now, for the audit trail."""
    return AuditNote(Actor(caller.owner, caller.token_id, caller.token_name), clock_of(request).now(),
                     request_id_of(request.scope))
