"""Due triggers held in memory until their second comes.

A min-heap ordered by fire time: inserting is O(log n) and the node only ever asks "what is due
now?". It holds just the look-ahead window (a few seconds of triggers), never the whole index, and
it is only a cache: every trigger it holds is still in the database until fired, so losing it (a
crash, a lost partition) delays fires by one scan and loses none.

It also keeps, per partition, how many triggers it holds or has in flight and the sum of their fire
times: compared with the same sums over the database's triggers, they say which partitions gained or
lost a trigger since the node read them, without reading every key again (chimes.scheduler.node).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Collection, Iterable
from datetime import UTC, datetime, timedelta

from chimes.store.scheduling import DueTrigger, TriggerSums

Key = tuple[int, datetime, object]
SET_ASIDE_LIMIT = 10_000  # keys remembered; past this the oldest are forgotten (and tried once more)
# A trigger set aside is tried again after this long: if what failed was not the trigger after all
# (a fault of the code that a restart or a fix ends), it fires late, not never.
SET_ASIDE_SEC = 600.0
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MICROSECOND = timedelta(microseconds=1)


def micros(at: datetime) -> int:
    """Microseconds since the epoch, exactly (as the database sums them)."""
    return (at - EPOCH) // MICROSECOND


class TimerWheel:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Key]] = []
        self._held: dict[Key, DueTrigger] = {}
        self._in_flight: set[Key] = set()
        # key -> (job version, monotonic time it may be tried again); insertion order: oldest first
        self._set_aside: dict[Key, tuple[int, float]] = {}
        self._order = itertools.count()
        self._sums: dict[int, list[int]] = {}  # partition -> [triggers held or in flight, sum of micros(fire_at)]

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: Key) -> bool:
        return key in self._held or key in self._in_flight

    def add(self, trigger: DueTrigger) -> bool:
        """Hold a trigger unless it is already held or being fired; True if it was added."""
        key = trigger.key
        if key in self or self._is_set_aside(trigger):
            return False
        due = trigger.fire_at.timestamp()  # first: a time that cannot be one raises before anything changes
        fire_micros = micros(trigger.fire_at)
        self._held[key] = trigger
        self._count(key[0], 1, fire_micros)
        heapq.heappush(self._heap, (due, next(self._order), key))
        return True

    def add_all(self, triggers: Iterable[DueTrigger]) -> int:
        return sum(self.add(t) for t in triggers)

    def next_due(self) -> float | None:
        """The epoch second of the earliest held trigger (dropped ones may linger at the top)."""
        return self._heap[0][0] if self._heap else None

    def count_due(self, until: float, enough: int) -> int:
        """How many held triggers are due by ``until``, counted up to ``enough`` (a walk of the heap's
        entries due by then, never of the rest; dropped entries that linger count too)."""
        heap, count, stack = self._heap, 0, [0]
        while stack and count < enough:
            i = stack.pop()
            if i < len(heap) and heap[i][0] <= until:
                count += 1
                stack += (2 * i + 1, 2 * i + 2)
        return count

    def pop_due(self, now: float, limit: int | None = None) -> list[DueTrigger]:
        """Remove and return the triggers due at ``now``; they count as in flight until :meth:`done`."""
        due: list[DueTrigger] = []
        while self._heap and self._heap[0][0] <= now and (limit is None or len(due) < limit):
            _, _, key = heapq.heappop(self._heap)
            trigger = self._held.pop(key, None)
            if trigger is not None:
                self._in_flight.add(key)
                due.append(trigger)
        return due

    def done(self, triggers: Iterable[DueTrigger]) -> None:
        for trigger in triggers:
            key = trigger.key
            if key in self._in_flight:
                self._in_flight.remove(key)
                self._count(key[0], -1, micros(key[1]))

    def sums(self) -> TriggerSums:
        """Per partition: how many triggers are held or in flight, and the sum of their fire times in
        microseconds since the epoch. Partitions with none are left out."""
        return {partition: (count, total) for partition, (count, total) in self._sums.items()}

    def _count(self, partition: int, sign: int, fire_micros: int) -> None:
        sums = self._sums.get(partition)
        if sums is None:
            sums = self._sums[partition] = [0, 0]
        sums[0] += sign
        sums[1] += sign * fire_micros
        if not sums[0]:
            del self._sums[partition]

    def set_aside(self, trigger: DueTrigger) -> None:
        """Do not hold this trigger again (poison: handling it failed) for SET_ASIDE_SEC, or until its
        job is edited."""
        key = trigger.key
        if self._held.pop(key, None) is not None or key in self._in_flight:
            self._in_flight.discard(key)
            self._count(key[0], -1, micros(key[1]))
        self._set_aside.pop(key, None)
        self._set_aside[key] = (trigger.job_version, time.monotonic() + SET_ASIDE_SEC)
        if len(self._set_aside) > SET_ASIDE_LIMIT:
            del self._set_aside[next(iter(self._set_aside))]

    def _is_set_aside(self, trigger: DueTrigger) -> bool:
        entry = self._set_aside.get(trigger.key)
        if entry is None:
            return False
        version, until = entry
        if version == trigger.job_version and time.monotonic() < until:
            return True
        del self._set_aside[trigger.key]
        return False

    def drop_partitions(self, partitions: Collection[int]) -> int:
        """Forget the triggers of partitions this node no longer holds (the heap entries go lazily)."""
        lost = [key for key in self._held if key[0] in partitions]
        for key in lost:
            del self._held[key]
            self._count(key[0], -1, micros(key[1]))
        return len(lost)
