"""The worker's heartbeat: its row, the leases of the runs it holds, the slots of its capped runs,
and the runs that were taken away from it meanwhile (cancelled or reaped), which it stops."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Mapping

from chimes import failures
from chimes.logs import run_fields
from chimes.store.db import DB_ERRORS
from chimes.store.working import ClaimedRun
from chimes.worker.completer import Completer
from chimes.worker.leases import ClaimLeases
from chimes.worker.slot_keeper import SlotKeeper
from chimes.worker.stores import HeartbeatStore

log = logging.getLogger("chimes.worker.worker")  # the worker's: its parts' records keep the name they had


class Heartbeat:
    def __init__(self, store: HeartbeatStore, *, every_sec: float, lease_sec: float, concurrency: int,
                 running: Mapping[uuid.UUID, tuple[ClaimedRun, asyncio.Task[None]]], taken: set[uuid.UUID],
                 completer: Completer, leases: ClaimLeases, slots: SlotKeeper) -> None:
        """``running``: the worker's runs in flight; ``taken``: where the runs it stops because they
        are no longer this worker's are noted, for the worker to tell them from those it gave up."""
        self._store = store
        self._every_sec = every_sec
        self._lease_sec = lease_sec
        self._concurrency = concurrency
        self._running = running
        self._taken = taken
        self._completer = completer
        self._leases = leases
        self._slots = slots

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(self._every_sec)
            try:
                await self.beat()
            except Exception as exc:
                failures.loop_failed("worker", "heartbeat", exc)

    async def beat(self) -> None:
        cap_slots = self._slots.cap_slots
        if cap_slots is not None:  # first, and whether this home's database answers or not
            try:
                await self._slots.renew(cap_slots, self._lease_sec)
            except DB_ERRORS as exc:  # this home's leases are still extended below
                failures.loop_failed("worker", "cap slots", exc)
            finally:
                self._slots.stop_runs_losing_their_slots(self._running, self._every_sec)
        await self._store.register(socket.gethostname(), os.getpid(), self._concurrency, len(self._running))
        # Runs whose outcome waits in the buffer still need their lease until it is written.
        held = [run for run, _ in self._running.values()] + [o.run for o in self._completer.outcomes]
        asked = {run.run_id for run in held}
        still_held = await self._store.extend_leases(held, self._lease_sec)
        # Only runs this round asked about: one claimed while it waited was not, and is not lost.
        for run_id, (_run, task) in list(self._running.items()):
            if run_id in asked and run_id not in still_held:
                log.warning("run %s was taken away (cancelled or reaped); stopping it", run_id,
                            extra=run_fields(_run))
                self._taken.add(run_id)
                task.cancel()
        await self._completer.give_up_refused()
        # Claims that ended while no outcome was written to take their rows along (a cancel, say).
        forget = self._leases.take_forgotten()
        try:
            await self._store.forget_claims(forget)
        except BaseException:
            self._leases.forget_later(forget)
            raise
