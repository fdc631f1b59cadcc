"""The database's clock as a scheduler node follows it: the host's clock plus a measured offset.

The database decides whether a trigger's time has come (``fire_triggers``). A node whose host clock
runs ahead sends its fires early; the database refuses them, and they fire only after the node's
next scan, up to a second late. A node whose clock runs behind fires late by its whole offset. So
the node measures how far its clock is from the database's and sends each fire when the database's
clock, not its own, reaches the trigger's time.

A sample reads the database's clock between two readings of the host's, on one connection. The
database read its clock somewhere inside that round trip, so the true offset lies between
``database - received`` and ``database - sent``. The node takes the lower bound: then its corrected
clock is never ahead of the database's, and it is behind by at most the round trip. Of the recent
samples it keeps the one with the shortest round trip (the way NTP filters its samples), so that a
sample taken while the database was busy does not make every fire late.
"""

from __future__ import annotations

import logging
from collections import deque
from datetime import UTC, datetime

from chimes.clock import Clock
from chimes.store.scheduling import ClockSample

log = logging.getLogger(__name__)

SAMPLES_KEPT = 16  # one a lease round: the shortest round trip of the last ~16 s
NOTABLE_OFFSET_SEC = 0.5  # an offset this large is logged: the host's time service deserves a look


class DatabaseClock:
    """The host's clock, corrected by the offset measured from the database's."""

    def __init__(self, host: Clock, follow: bool = True) -> None:
        self.host = host
        self.follow = follow  # False: the host's clock as it is (the database still refuses early fires)
        self._samples: deque[ClockSample] = deque(maxlen=SAMPLES_KEPT)
        self._offset = 0.0
        self._logged_offset: float | None = None

    @property
    def offset_sec(self) -> float:
        """How far the database's clock is ahead of the host's, at most; 0 before the first sample."""
        return self._offset

    def record(self, sample: ClockSample) -> None:
        if sample.received < sample.sent:  # the host's clock stepped back mid-sample: it says nothing
            return
        self._samples.append(sample)
        best = min(self._samples, key=lambda s: s.received - s.sent)
        self._offset = best.database - best.received
        self._log_if_notable()

    def time(self) -> float:
        """Seconds since the epoch by the database's clock, never ahead of it."""
        return self.host.time() + (self._offset if self.follow else 0.0)

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.time(), UTC)

    def _log_if_notable(self) -> None:
        offset = self._offset
        notable = abs(offset) >= NOTABLE_OFFSET_SEC
        was_notable = self._logged_offset is not None and abs(self._logged_offset) >= NOTABLE_OFFSET_SEC
        if notable and (not was_notable or abs(offset - (self._logged_offset or 0.0)) >= NOTABLE_OFFSET_SEC):
            log.warning("this host's clock is %.3f s %s the database's; %s", abs(offset),
                        "ahead of" if offset < 0 else "behind",
                        "fires follow the database's clock" if self.follow else "fires follow the host's clock")
            self._logged_offset = offset
        elif not notable and was_notable:
            log.info("this host's clock is back within %.1f s of the database's", NOTABLE_OFFSET_SEC)
            self._logged_offset = offset
