"""The cap slots a worker holds in the catalog (with a shard map that has ranges, docs/scaling.md):
which runs hold them, when they lapse, renewing and freeing them."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping

from chimes import failures
from chimes.logs import run_fields
from chimes.store.cap_slots import CapSlots
from chimes.store.db import DB_ERRORS
from chimes.store.working import ClaimedRun
from chimes.worker.stores import CallbackStore

log = logging.getLogger("chimes.worker.worker")  # the worker's: its parts' records keep the name they had


class SlotKeeper:
    def __init__(self, store: CallbackStore, worker_id: str, cap_slots: CapSlots | None, shard_id: int | None,
                 to_flush: asyncio.Event) -> None:
        """``cap_slots`` None: caps are counted from the running runs of the worker's database, and
        no run holds slots. ``to_flush``: set when slots wait to be freed by the flush loop."""
        self.cap_slots = cap_slots
        self.shard_id = shard_id
        self._store = store
        self._worker_id = worker_id
        self._to_flush = to_flush
        self.slotted: set[uuid.UUID] = set()  # runs holding slots in the catalog
        self.to_free: list[uuid.UUID] = []  # their runs left this worker's hands
        self._callbacks: dict[uuid.UUID, ClaimedRun] = {}  # holding slots, their outcome due from the target
        self._deadlines: dict[uuid.UUID, float] = {}  # monotonic: when their slots lapse at the earliest

    def took(self, claimed: list[ClaimedRun], started: float, lease_sec: float) -> None:
        """``claimed`` took slots, from ``started`` (monotonic) on, for ``lease_sec``."""
        self.slotted.update(run.run_id for run in claimed)
        self._deadlines.update(dict.fromkeys((run.run_id for run in claimed), started + lease_sec))

    def handed_to_target(self, run: ClaimedRun) -> None:
        """``run``'s target reports its outcome itself: its slots are kept while it is still running."""
        if run.run_id in self.slotted:
            self.slotted.discard(run.run_id)
            self._callbacks[run.run_id] = run

    def stopped(self, run_id: uuid.UUID) -> None:
        """A run holding slots stopped here without an outcome (cancelled, taken away or handed back)."""
        self.slotted.discard(run_id)
        self.to_free.append(run_id)
        self._to_flush.set()

    def ended(self, done: set[uuid.UUID]) -> None:
        """``done`` runs are this worker's no more (outcome recorded, or refused)."""
        self.to_free += [run_id for run_id in done if run_id in self.slotted]
        self.slotted -= done

    async def free(self) -> None:
        """Free the catalog's slots of runs that ended here. When the catalog does not answer, they
        lapse with their lease, no longer renewed: the cap is under-used meanwhile, never exceeded."""
        if self.cap_slots is None or not self.to_free:
            return
        freeing, self.to_free = self.to_free, []
        for run_id in freeing:
            self._deadlines.pop(run_id, None)
        try:
            await self.cap_slots.free(freeing, self._worker_id)
        except DB_ERRORS as exc:
            log.warning("could not free the cap slots of %d runs (%s); they lapse with their lease", len(freeing),
                        failures.describe(exc))

    async def renew(self, slots: CapSlots, lease_sec: float) -> None:
        """The slots of the runs this worker runs (or whose outcome waits to be written), and of those
        a target still runs (callback tasks), last another lease; those of callback runs that ended
        are freed with the next flush."""
        renewing = list(self.slotted)
        if self._callbacks:
            try:
                running = await self._store.still_running(list(self._callbacks.values()))
            except DB_ERRORS:  # this home does not answer: keep them while it cannot tell
                running = set(self._callbacks)
            for run_id in [run_id for run_id in self._callbacks if run_id not in running]:
                del self._callbacks[run_id]
                self.to_free.append(run_id)
                self._to_flush.set()
            renewing += running
        started = time.monotonic()
        await slots.renew(renewing, self._worker_id, lease_sec)
        self._deadlines.update(dict.fromkeys(renewing, started + lease_sec))

    def stop_runs_losing_their_slots(self, running: Mapping[uuid.UUID, tuple[ClaimedRun, asyncio.Task[None]]],
                                     heartbeat_every_sec: float) -> None:
        """A run whose slots could not be renewed (the catalog does not answer) and could lapse before
        the next heartbeat is done is stopped, as one whose lease was lost: after the lapse another
        worker may take the slot, and the cap must not be exceeded. Its run is retried after its
        lease. Half a heartbeat more than one: a heartbeat may come late, and a run may have been
        claimed just before the last one."""
        soon = time.monotonic() + 1.5 * heartbeat_every_sec
        for run_id, deadline in list(self._deadlines.items()):
            if deadline > soon:
                continue
            del self._deadlines[run_id]
            held = running.get(run_id)
            if held is not None:
                log.warning("the cap slots of run %s could not be renewed; stopping it", run_id,
                            extra=run_fields(held[0]))
                held[1].cancel()
            elif self._callbacks.pop(run_id, None) is not None:
                log.warning("the cap slots of run %s, which its target runs, could not be renewed and lapse",
                            run_id)
