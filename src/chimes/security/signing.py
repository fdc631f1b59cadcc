"""Signed outgoing calls: every HTTP task request carries an HMAC-SHA256 over timestamp and body,
keyed with its owner's signing secret, so the target can tell that Chimes sent it.

Header: ``X-Chimes-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>." + body)>``.
The secret is the string ``chimes owner signing-secret TEAM`` prints, used as UTF-8 bytes.
A target recomputes the HMAC, compares in constant time and refuses timestamps older than a few
minutes (docs/security.md has a ten-line example).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

SIGNATURE_HEADER = "X-Chimes-Signature"
SECRET_PREFIX = "whsec_"
DEFAULT_TOLERANCE_SEC = 300


def new_signing_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def signature(secret: str, timestamp: int, body: bytes) -> str:
    return hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def signature_header(secret: str, timestamp: int, body: bytes) -> str:
    return f"t={timestamp},v1={signature(secret, timestamp, body)}"


def verify(secret: str, header: str, body: bytes, now: float, tolerance_sec: int = DEFAULT_TOLERANCE_SEC) -> bool:
    """Whether ``header`` signs ``body`` with ``secret`` at a time within ``tolerance_sec`` of ``now``."""
    fields = dict(part.split("=", 1) for part in header.split(",") if "=" in part)
    try:
        timestamp = int(fields.get("t", ""))
    except ValueError:
        return False
    if abs(now - timestamp) > tolerance_sec:
        return False
    return hmac.compare_digest(fields.get("v1", ""), signature(secret, timestamp, body))
