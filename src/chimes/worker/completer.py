"""The worker's outcomes: buffered, written together every few milliseconds, and, when the database
refuses one, recorded without its text or given up (never lost: the reaper brings the run back)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from chimes import failures, tracing
from chimes.logs import run_fields
from chimes.store.db import DB_ERRORS
from chimes.store.working import ClaimedRun, Completion
from chimes.timeouts import wait_event
from chimes.worker.leases import ClaimLeases
from chimes.worker.reporting import report_outcomes
from chimes.worker.slot_keeper import SlotKeeper
from chimes.worker.stores import OutcomeStore
from chimes.worker.tasks.common import MAX_ERROR_CHARS, Outcome

log = logging.getLogger("chimes.worker.worker")  # the worker's: its parts' records keep the name they had
# How long the runs whose outcome was refused are given up again at every heartbeat (give_up_refused):
# past a failover of the database, which takes a failover manager well under a minute.
REFUSED_GIVE_UP_SEC = 300.0
REFUSED_REMEMBERED = 10_000


class Completer:
    def __init__(self, store: OutcomeStore, leases: ClaimLeases, slots: SlotKeeper, to_flush: asyncio.Event,
                 flush_every_sec: float) -> None:
        """``to_flush``: set with something for the flush loop (an outcome, a run to give up, a slot
        to free); the worker's runs set it as they append to :attr:`outcomes` themselves."""
        self.completed = 0
        # The worker appends each run's outcome here itself rather than through a call: it is done for
        # every run.
        self.outcomes: list[Completion] = []
        self.to_give_up: list[ClaimedRun] = []  # runs stopped here that are still this worker's
        self.to_flush = to_flush
        self._store = store
        self._leases = leases
        self._slots = slots
        self._flush_every_sec = flush_every_sec
        self._drained = asyncio.Event()
        self._unrecordable: set[uuid.UUID] = set()  # runs whose outcome text the database refused
        # Runs whose outcome was refused, by run id: (monotonic time of the refusal, run); give_up_refused.
        self._refused: dict[uuid.UUID, tuple[float, ClaimedRun]] = {}

    def finish(self) -> None:
        """The worker is drained: the flush loop ends after the flush it is in, if any."""
        self._drained.set()
        self.to_flush.set()

    async def loop(self) -> None:
        """Outcomes wait up to ``flush_every_sec`` to be written together. An idle worker does not
        wake up for nothing: with none to write the loop waits for the next one. It is never
        cancelled mid-write (that would lose the batch it holds): it is told to :meth:`finish`."""
        while not self._drained.is_set():
            if not self.outcomes and not self._slots.to_free and not self.to_give_up:
                self.to_flush.clear()
                await self.to_flush.wait()
                continue
            await wait_event(self._drained, self._flush_every_sec)
            try:
                await self.flush()
            except Exception as exc:
                failures.loop_failed("worker", "flush", exc)

    async def _give_up(self) -> None:
        if not self.to_give_up:
            return
        giving_up, self.to_give_up = self.to_give_up, []
        try:
            await self._store.give_up(giving_up)
        except DB_ERRORS as exc:
            # Tried again with the next flush; meanwhile they are reaped once their claim's lease expires.
            self.to_give_up[:0] = giving_up
            failures.loop_failed("worker", "give up", exc)
            return
        for run in giving_up:
            self._leases.settle(run)

    async def flush(self) -> None:
        await self._slots.free()
        await self._give_up()
        if not self.outcomes:
            return
        batch, self.outcomes = self.outcomes, []
        forget = self._leases.take_forgotten()
        try:
            # One outcome the database refuses must not keep everyone else's from being recorded.
            recorded = await failures.narrow_down(batch, lambda part: self._store.complete(part, forget),
                                                  self._unrecordable_outcome)
        except Exception as exc:
            failures.loop_failed("worker", "flush", exc)
            self.outcomes[:0] = batch  # keep them; the leases are still extended meanwhile
            self._leases.forget_later(forget)
            return
        if not recorded:
            self._leases.forget_later(forget)
        accepted = set().union(*recorded)
        self._unrecordable -= accepted
        # Recorded, or refused because the lease was lost: either way this worker runs it no more.
        done = {c.run.run_id for c in batch if c.run.run_id in accepted or c.run.run_id not in self._unrecordable}
        giving_up = {run.run_id for run in self.to_give_up}  # outcomes set aside: still running, still ours
        for completion in batch:
            if completion.run.run_id in done and completion.run.run_id not in giving_up:
                self._leases.settle(completion.run)
        refused_at = time.monotonic()
        for completion in batch:
            if completion.run.run_id in done and completion.run.run_id not in accepted:
                self._refused[completion.run.run_id] = (refused_at, completion.run)
        self._slots.ended(done)
        await self._slots.free()
        self.completed += len(accepted)
        report_outcomes(batch, accepted)
        tracing.completed(batch, accepted)
        for outcome in batch:
            if outcome.run.run_id not in accepted:
                log.warning("outcome of run %s refused: the lease was lost (reaped or cancelled)",
                            outcome.run.run_id, extra=run_fields(outcome.run))

    def _unrecordable_outcome(self, completion: Completion, exc: Exception) -> None:
        """Record the attempt without its text, saying why; an outcome refused even so is given up,
        and its run comes back through the reaper when its lease expires (never lost)."""
        run_id = completion.run.run_id
        if run_id in self._unrecordable:
            self._unrecordable.discard(run_id)
            failures.set_aside("worker", "outcome", f"outcome of run {run_id}", exc)
            self.to_give_up.append(completion.run)
            return
        self._unrecordable.add(run_id)
        log.warning("the outcome of run %s could not be recorded (%s); recording it without its text", run_id,
                    failures.describe(exc), extra=run_fields(completion.run))
        without_text = Outcome(completion.outcome.status,
                               f"the outcome's text could not be stored: {failures.describe(exc)}"[:MAX_ERROR_CHARS])
        self.outcomes.append(Completion(completion.run, without_text, completion.finished_at, completion.retry_at))

    async def give_up_refused(self) -> None:
        """Give up again, for a while, the runs whose outcome was refused. A refusal most often means
        the lease was lost, and then this changes nothing. But it also follows a write that timed out
        waiting for a synchronous standby: committed on the primary, never replicated. Once the standby
        is promoted, the run is still running there under this worker's claim, whose lease row the
        heartbeat extends for the claim's other runs and the claim's last outcome deletes: the run would
        wait for the rest of its claim, then for nobody. An expired lease of its own (give_up_runs) has
        the reaper end the attempt as a lost one, to be retried."""
        if not self._refused:
            return
        since = time.monotonic() - REFUSED_GIVE_UP_SEC
        kept = [(at, run) for at, run in self._refused.values() if at >= since][-REFUSED_REMEMBERED:]
        self._refused = {run.run_id: (at, run) for at, run in kept}
        if kept:
            await self._store.give_up([run for _, run in kept])
