"""Bearer-token authentication and scopes: every endpoint but /healthz and /openapi.json runs as a
Principal, and only a token whose scope allows the request gets past this.

Owner isolation is the stores' job (every query takes ``owner_filter``); the scope is checked here,
by method, for every route that depends on :func:`current_principal`: a ``read`` token may only
read (GET, HEAD). Each token is checked as a guess of the client's address
(``limits.judge_credential``): charged to its budget of failed attempts first, counted and logged
when it fails.
"""

from __future__ import annotations

from fastapi import Request

from chimes.api import standby
from chimes.api.errors import ApiError
from chimes.api.limits import judge_credential
from chimes.store.tokens import Principal, authenticate

_CHALLENGE = {"WWW-Authenticate": "Bearer"}
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


async def current_principal(request: Request) -> Principal:
    principal = await reading_principal(request)
    check_scope(principal, request.method)
    return principal


async def reading_principal(request: Request) -> Principal:
    """The caller, whatever its scope: for a POST that changes nothing (a preview), which a read-only
    token may make."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if not header:
        raise ApiError(401, "unauthorized", "missing Authorization: Bearer <token> header", headers=_CHALLENGE)
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "unauthorized", "Authorization header must be 'Bearer <token>'", headers=_CHALLENGE)
    pool = standby.pool(request)
    principal = await judge_credential(request.scope, token.strip(), lambda guess: authenticate(pool, guess))
    if principal is None:
        raise ApiError(401, "unauthorized", "invalid or revoked token", headers=_CHALLENGE)
    return principal


def check_scope(principal: Principal, method: str) -> None:
    """403 unless the principal's scope allows ``method``: a read-only token only reads."""
    if method.upper() not in READ_METHODS and not principal.can_write:
        raise ApiError(403, "forbidden",
                       f"this token is read-only (scope 'read'): {method.upper()} needs a token with scope "
                       "'write' or 'admin'")
