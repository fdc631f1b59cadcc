"""A hard cap on request body size, enforced before any handler reads the body."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chimes.api.errors import error_body
from chimes.api.responses import JSONResponse

DEFAULT_MAX_BODY_BYTES = 1024 * 1024


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._reject(scope, receive, send)
            return
        received = 0
        rejected = False

        async def limited_receive() -> Message:
            # Past the limit, answer 413 ourselves and tell the app the client went away; whatever
            # the app then tries to send is dropped.
            nonlocal received, rejected
            if rejected:
                return {"type": "http.disconnect"}
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                rejected = True
                await self._reject(scope, receive, send)
                return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not rejected:
                await send(message)

        await self.app(scope, limited_receive, guarded_send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"request body is larger than the limit of {self.max_bytes} bytes"
        await JSONResponse(error_body("payload_too_large", message, "body"), 413)(scope, receive, send)
