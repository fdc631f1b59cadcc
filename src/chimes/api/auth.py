"""Bearer-token authentication: every endpoint but /healthz runs as a Principal."""

from __future__ import annotations

from fastapi import Request

from chimes.api.errors import ApiError
from chimes.store.tokens import Principal, authenticate

_CHALLENGE = {"WWW-Authenticate": "Bearer"}


async def current_principal(request: Request) -> Principal:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if not header:
        raise ApiError(401, "unauthorized", "missing Authorization: Bearer <token> header", headers=_CHALLENGE)
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "unauthorized", "Authorization header must be 'Bearer <token>'", headers=_CHALLENGE)
    principal = await authenticate(request.app.state.pool, token.strip())
    if principal is None:
        raise ApiError(401, "unauthorized", "invalid or revoked token", headers=_CHALLENGE)
    return principal
