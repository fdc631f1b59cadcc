"""The receiving side of Chimes' HTTP tasks, for Python targets (docs/receiver.md).

``Receiver`` verifies a call's signature and age with the owner's signing secret, exposes the run's
identity (:class:`ChimesCall`), deduplicates on ``Idempotency-Key`` and, for long work answered with
202, heartbeats and completes the run through the callbacks. Adapters: :mod:`chimes.receiver.asgi`
(FastAPI, Starlette) and :mod:`chimes.receiver.aiohttp`.
"""

from chimes.receiver.callbacks import CallbackError, LeaseLost, RunReporter
from chimes.receiver.calls import CallRejected, ChimesCall, verify_call
from chimes.receiver.dedupe import IdempotencyStore, MemoryIdempotencyStore, Seen
from chimes.receiver.receiver import Receiver, Work

__all__ = [
    "CallRejected",
    "CallbackError",
    "ChimesCall",
    "IdempotencyStore",
    "LeaseLost",
    "MemoryIdempotencyStore",
    "Receiver",
    "RunReporter",
    "Seen",
    "Work",
    "verify_call",
]
