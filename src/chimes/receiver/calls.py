"""One call from Chimes as a target sees it: verified, with the run's identity parsed.

Framework-free: it takes the headers and the raw body, so the ASGI and aiohttp adapters
(:mod:`chimes.receiver.asgi`, :mod:`chimes.receiver.aiohttp`) are a few lines each. The signature
check is the one of :mod:`chimes.security.signing`, the code Chimes signs with.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from chimes.security.signing import DEFAULT_TOLERANCE_SEC, SIGNATURE_HEADER, signature_problem

__all__ = ["CallRejected", "ChimesCall", "verify_call"]


class CallRejected(Exception):
    """A request that is not a valid call from Chimes; ``status`` is what to answer (401 or 400)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ChimesCall:
    """What Chimes says about the run it is calling for; every field comes from its headers."""

    run_id: str
    job_id: str
    attempt: int
    scheduled_at: datetime  # aware, UTC: the slot the run is for, not when it was sent
    idempotency_key: str  # the run id, the same on every attempt: deduplicate on it
    lease_token: str | None  # for the callbacks of a run answered with 202
    traceparent: str | None  # W3C trace context of the run (docs/tracing.md)
    body: bytes


def _header(headers: Mapping[str, str], name: str) -> str:
    value = headers.get(name)
    if value is None:
        raise CallRejected(400, f"missing header {name}")
    return value


def verify_call(headers: Mapping[str, str], body: bytes, secrets: str | Iterable[str], *,
                tolerance_sec: float = DEFAULT_TOLERANCE_SEC,
                clock: Callable[[], float] = time.time) -> ChimesCall:
    """The call ``headers`` and ``body`` make, once its signature and age are checked.

    ``headers`` must look names up case-insensitively (every framework's header mapping does);
    ``body`` is the raw body as received. ``secrets``: the owner's signing secret (``chimes owner
    signing-secret TEAM``), or several while one is being rotated. Raises :class:`CallRejected`: 401
    for a missing, forged or stale signature, 400 for a signed call without Chimes' headers.
    """
    problem = signature_problem(secrets, headers.get(SIGNATURE_HEADER, ""), body, clock(), tolerance_sec)
    if problem is not None:
        raise CallRejected(401, problem)
    try:
        attempt = int(_header(headers, "X-Chimes-Attempt"))
        scheduled_at = datetime.fromisoformat(_header(headers, "X-Chimes-Scheduled-At"))
    except ValueError as exc:
        raise CallRejected(400, f"malformed Chimes header: {exc}") from None
    return ChimesCall(
        run_id=_header(headers, "X-Chimes-Run-Id"),
        job_id=_header(headers, "X-Chimes-Job-Id"),
        attempt=attempt,
        scheduled_at=scheduled_at,
        idempotency_key=_header(headers, "Idempotency-Key"),
        lease_token=headers.get("X-Chimes-Lease-Token"),
        traceparent=headers.get("traceparent"),
        body=body,
    )
