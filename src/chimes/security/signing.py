"""Signed outgoing calls: every HTTP task request carries an HMAC-SHA256 over timestamp and body,
keyed with its owner's signing secret, so the target can tell that Chimes sent it.

Header: ``X-Chimes-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>." + body)>``.
The secret is the string ``chimes owner signing-secret TEAM`` prints, used as UTF-8 bytes.
A target recomputes the HMAC, compares in constant time and refuses timestamps older than a few
minutes (docs/security.md has a ten-line example).
"""

from __future__ import annotations

import functools
import hmac
import secrets
from collections.abc import Iterable

SIGNATURE_HEADER = "X-Chimes-Signature"
SECRET_PREFIX = "whsec_"
DEFAULT_TOLERANCE_SEC = 300


def new_signing_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def signature(secret: str, timestamp: int, body: bytes) -> str:
    return hmac.digest(secret.encode(), f"{timestamp}.".encode() + body, "sha256").hex()


def signature_header(secret: str, timestamp: int, body: bytes) -> str:
    if len(body) > _CACHED_BODY_BYTES:
        return _signature_header(secret, timestamp, body)
    return _cached_signature_header(secret, timestamp, body)


def _signature_header(secret: str, timestamp: int, body: bytes) -> str:
    return f"t={timestamp},v1={signature(secret, timestamp, body)}"


#: The calls of a burst share their owner's secret, the second and, most often, the body: their header
#: is computed once. Bodies this small only, so that the cache stays a few hundred KB at most.
_CACHED_BODY_BYTES = 1024
_cached_signature_header = functools.lru_cache(maxsize=256)(_signature_header)


def verify(secret: str, header: str, body: bytes, now: float, tolerance_sec: int = DEFAULT_TOLERANCE_SEC) -> bool:
    """Whether ``header`` signs ``body`` with ``secret`` at a time within ``tolerance_sec`` of ``now``."""
    return signature_problem(secret, header, body, now, tolerance_sec) is None


def signature_problem(secret: str | Iterable[str], header: str, body: bytes, now: float,
                      tolerance_sec: float = DEFAULT_TOLERANCE_SEC) -> str | None:
    """Why ``header`` does not sign ``body`` at ``now``, or None when it does.

    ``secret`` may be several (a team rotating its secret accepts the old and the new one for a
    while); the reasons are for the receiver's logs, not for the caller, who learns only a 401.
    """
    fields = dict(part.split("=", 1) for part in header.split(",") if "=" in part)
    try:
        timestamp = int(fields.get("t", ""))
    except ValueError:
        return "no timestamp in the signature header" if header else "no signature header"
    if abs(now - timestamp) > tolerance_sec:
        when = f"{now - timestamp:.0f} s ago" if now >= timestamp else f"{timestamp - now:.0f} s ahead"
        return f"signed {when}, beyond the tolerance of {tolerance_sec:g} s (a replay, or a wrong clock)"
    secrets_ = [secret] if isinstance(secret, str) else list(secret)
    given = fields.get("v1", "")
    if not any(hmac.compare_digest(given, signature(each, timestamp, body)) for each in secrets_):
        return "the signature does not match the body (another secret, or a changed body)"
    return None
