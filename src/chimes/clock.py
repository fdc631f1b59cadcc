"""The wall clock a role reads, given to it so that a test can run a role on a clock that is off.

Python's clock serves what one process decides alone: when a node sends a fire (the timer wheel)
and the fire time it plans slots from, both corrected by the node's measured offset from the
database's clock (chimes.scheduler.database_clock); when an attempt finished and how long its retry
waits; and in the API a new job's first fire time or whether a backfill's end is past
(chimes.api.clock). What several
processes must agree on is judged by the database's ``now()`` instead, deliberately: whether a
trigger's time has come (``fire_triggers``), whether a partition lease is held or free
(``sync_leases``, ``fire_triggers``), whether a run's lease or deadline has passed (the reaper's
``expired_runs``), all in ``store/sql/scheduling.sql``, and when a retry is due: the backoff a worker
or the reaper chose, counted from the database's ``now()`` (``complete_runs``, ``reap_runs``). One
clock for every node, so a node whose host clock drifts can neither fire early nor keep a fence it lost
(tests/integration/test_clock_skew.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime

__all__ = ["SYSTEM_CLOCK", "Clock"]


@dataclass(frozen=True, slots=True)
class Clock:
    """The host's wall clock, ``offset_sec`` ahead of it (behind when negative; tests only)."""

    offset_sec: float = 0.0

    def time(self) -> float:
        """Seconds since the epoch, as ``time.time()``."""
        return time.time() + self.offset_sec

    def now(self) -> datetime:
        """The same instant as an aware UTC datetime."""
        return datetime.fromtimestamp(self.time(), UTC)


SYSTEM_CLOCK = Clock()
