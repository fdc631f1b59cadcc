"""Deduplicating calls on their ``Idempotency-Key``: Chimes delivers at least once.

The same run reaches a target again when an attempt failed (a retry), when a worker died after the
target did the work (the reaper retries it), or when someone replays a captured call within the
signature's tolerance. A failed attempt must be done again; a finished one must not. So a store keeps
a state per key: ``begin`` claims the key (or says it is running or done), ``finish`` records a success
(kept for ``ttl_sec``) or forgets a failure so that the retry does the work.

:class:`IdempotencyStore` is the interface (implement it on Redis or a database table to share it
between processes); :class:`MemoryIdempotencyStore`, the default, serves one process.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

__all__ = ["DEFAULT_TTL_SEC", "IdempotencyStore", "MemoryIdempotencyStore", "Seen"]

#: How long a finished key is remembered: a day covers the reaper's retries and any replay window.
DEFAULT_TTL_SEC = 24 * 3600.0


class Seen(enum.Enum):
    FIRST = "first"  # nobody has this key: the caller now holds it and does the work
    RUNNING = "running"  # another call with this key is being handled right now
    DONE = "done"  # the work for this key was done

    @property
    def status(self) -> int:
        """What a duplicate answers: 200 when the work is done (Chimes records a success), 409 while
        it runs (the attempt fails and is retried later, when the first has finished or failed)."""
        return 409 if self is Seen.RUNNING else 200


class IdempotencyStore(Protocol):
    async def begin(self, key: str, ttl_sec: float) -> Seen:
        """Claim ``key`` if nobody holds it (``FIRST``), else say why not; atomic per key.
        A claim not finished within ``ttl_sec`` (its process died) lapses."""
        ...

    async def finish(self, key: str, succeeded: bool, ttl_sec: float) -> None:
        """Record the end of the claimed work: remembered as done for ``ttl_sec``, or forgotten."""
        ...


class MemoryIdempotencyStore:
    """Keys in this process's memory, the oldest dropped beyond ``max_keys``. Safe within one event
    loop: ``begin`` checks and claims without awaiting in between."""

    def __init__(self, max_keys: int = 100_000, clock: Callable[[], float] = time.monotonic) -> None:
        self._max_keys = max_keys
        self._clock = clock
        self._keys: OrderedDict[str, tuple[Seen, float]] = OrderedDict()

    async def begin(self, key: str, ttl_sec: float) -> Seen:
        now = self._clock()
        held = self._keys.get(key)
        if held is not None and held[1] > now:
            return held[0]
        self._put(key, Seen.RUNNING, now + ttl_sec)
        return Seen.FIRST

    async def finish(self, key: str, succeeded: bool, ttl_sec: float) -> None:
        if succeeded:
            self._put(key, Seen.DONE, self._clock() + ttl_sec)
        else:
            self._keys.pop(key, None)

    def _put(self, key: str, state: Seen, expires: float) -> None:
        self._keys[key] = (state, expires)
        self._keys.move_to_end(key)
        while len(self._keys) > self._max_keys:
            self._keys.popitem(last=False)
