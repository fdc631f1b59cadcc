"""The worker: claims runs, executes them under a heartbeated lease, records every outcome.

It runs the runs itself, and composes the parts that do the rest: the claim loop (claimer), the
outcomes' flush (completer), the lease rows of its claims (leases), the cap slots it holds in the
catalog (slot_keeper) and the heartbeat.

Claims and outcomes are batched: one statement claims up to the free slots, one statement extends
every held lease, and outcomes are flushed together every few milliseconds. Every write is
conditional on the run's lease token, so a worker that lost a run (reaped, cancelled) changes
nothing about it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field

from chimes import failures, tracing
from chimes.backoff import plan_retry
from chimes.clock import SYSTEM_CLOCK, Clock
from chimes.enums import Priority, RunStatus
from chimes.logs import run_fields
from chimes.security.storable import storable_text
from chimes.settings import RUN_LEASE_SEC, RUN_TIMEOUT_SEC, SHUTDOWN_GRACE_SEC, WORKER_CONCURRENCY
from chimes.store.cap_slots import CapSlots
from chimes.store.db import DB_ERRORS, Pool
from chimes.store.working import ClaimedRun, Completion, RunSignals, WorkerStore, open_claims_pool
from chimes.timeouts import wait_event
from chimes.worker.budget import SlotBudget
from chimes.worker.claimer import Claimer
from chimes.worker.completer import Completer
from chimes.worker.guard import TaskGuard
from chimes.worker.heartbeat import Heartbeat
from chimes.worker.leases import ClaimLeases
from chimes.worker.slot_keeper import SlotKeeper
from chimes.worker.stores import RunStore
from chimes.worker.tasks.common import MAX_ERROR_CHARS, Outcome, TaskContext
from chimes.worker.tasks.dispatch import Executors
from chimes.worker.tiers import TierPolicy

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    concurrency: int = WORKER_CONCURRENCY  # runs executed at once
    claim_batch: int = 100
    lease_sec: float = RUN_LEASE_SEC
    heartbeat_every_sec: float = 10.0
    poll_every_sec: float = 1.0  # fallback when no NOTIFY arrives
    listen_check_every_sec: float = 5.0  # a query on the LISTEN connection: a host that vanished is noticed
    listen_check_timeout_sec: float = 5.0
    flush_every_sec: float = 0.02
    shutdown_grace_sec: float = SHUTDOWN_GRACE_SEC
    deadline_grace_sec: float = 30.0  # the reaper abandons a run this long after its timeout
    tiers: TierPolicy = field(default_factory=TierPolicy)
    allow_commands: bool = False  # run command and container tasks (--allow-commands)


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Worker:
    def __init__(self, pool: Pool, dsn: str, config: WorkerConfig | None = None,
                 worker_id: str | None = None, executors: Executors | None = None,
                 guard: TaskGuard | None = None, clock: Clock = SYSTEM_CLOCK,
                 budget: SlotBudget | None = None, cap_slots: CapSlots | None = None,
                 shard_id: int | None = None, store: RunStore | None = None) -> None:
        """``budget``: the slots this worker shares with the process's other claim loops (one per
        shard); without it, ``config.concurrency`` alone bounds it. ``cap_slots``: with a shard map
        that has ranges, the catalog's slots that capped runs take first (docs/scaling.md), and
        ``shard_id`` this worker's home (None: the catalog); without it, caps are counted from the
        running runs of this worker's database, as with one database. ``store``: where runs are
        claimed and recorded (its worker id is this worker's); without it, ``pool``'s database."""
        self.config = config or WorkerConfig()
        self.store: RunStore = store or WorkerStore(pool, worker_id or new_worker_id())
        self.executors = executors or Executors()
        self.guard = guard or TaskGuard(pool, allow_commands=self.config.allow_commands)
        self._dsn = dsn
        self._clock = clock
        self._running: dict[uuid.UUID, tuple[ClaimedRun, asyncio.Task[None]]] = {}
        self._taken: set[uuid.UUID] = set()  # runs stopped because they are no longer this worker's
        self._slot_free = asyncio.Event()
        self._budget = budget
        if budget is not None:
            budget.watch(self._slot_free)
        self._stopping = asyncio.Event()
        to_flush = asyncio.Event()  # set with something for the flush loop: an outcome, a slot to free
        self._to_flush = to_flush
        self._leases = ClaimLeases()
        self._slots = SlotKeeper(self.store, self.store.worker_id, cap_slots, shard_id, to_flush)
        self._completer = Completer(self.store, self._leases, self._slots, to_flush, self.config.flush_every_sec)
        self._claimer = Claimer(self.store, self.config, running=self._running, leases=self._leases,
                                slots=self._slots, budget=budget, slot_free=self._slot_free,
                                stopping=self._stopping, execute=self._execute)
        self._heartbeat = Heartbeat(self.store, every_sec=self.config.heartbeat_every_sec,
                                    lease_sec=self.config.lease_sec, concurrency=self.config.concurrency,
                                    running=self._running, taken=self._taken, completer=self._completer,
                                    leases=self._leases, slots=self._slots)

    def count_caps_in(self, cap_slots: CapSlots | None) -> None:
        """The shard map gained (or lost) ranges while this worker ran: from its next claim on, capped
        runs take slots in the catalog (None: caps counted from this database's running runs). Runs
        already running hold none, as when a cap is set while they run (docs/scaling.md)."""
        self._slots.cap_slots = cap_slots

    @property
    def worker_id(self) -> str:
        return self.store.worker_id

    @property
    def completed(self) -> int:
        """The outcomes of runs this worker recorded."""
        return self._completer.completed

    @property
    def listening(self) -> bool:
        """Whether NOTIFY wakes this worker now (else it polls)."""
        return self._claimer.listening

    def stop(self) -> None:
        """Stop claiming; in-flight runs get the shutdown grace to finish, then are handed back."""
        self._stopping.set()
        self._claimer.wake.set()

    async def run(self) -> None:
        log.info("worker %s starting (concurrency %d)", self.worker_id, self.config.concurrency)
        await self.guard.start()  # a secret key that is not the database's stops the worker here
        claims = self.store.claims = await open_claims_pool(self._dsn)
        with contextlib.suppress(*DB_ERRORS):
            await self.store.register(socket.gethostname(), os.getpid(), self.config.concurrency, 0)
        listener = asyncio.create_task(self._listen_loop())
        heartbeat = asyncio.create_task(self._heartbeat.loop())
        flusher = asyncio.create_task(self._completer.loop())
        try:
            await self._claimer.loop()
            await self._drain()
        finally:
            heartbeat.cancel()
            listener.cancel()
            # The flusher is never cancelled mid-write (that would lose the batch it holds): it is
            # told to stop and finishes its last flush.
            self._completer.finish()
            await asyncio.gather(heartbeat, listener, flusher, return_exceptions=True)
            await self._completer.flush()
            with contextlib.suppress(*DB_ERRORS):  # else they are deleted by a reaper once expired
                await self.store.forget_claims(self._leases.take_forgotten())
            with contextlib.suppress(*DB_ERRORS):
                await self.store.forget()
            await self.executors.close()
            with contextlib.suppress(*DB_ERRORS):
                await claims.close()
            log.info("worker %s stopped after %d runs", self.worker_id, self.completed)

    async def _listen_loop(self) -> None:
        """Hold a LISTEN connection that wakes the claim loop. When the database drops it (a restart, a
        failover), open another: meanwhile the worker only polls, starting runs up to a poll late."""
        while True:
            try:
                await self._listen_until_lost()
                log.warning("the LISTEN connection was lost; polling until it is back")
            except Exception as exc:
                failures.loop_failed("worker", "listen", exc)
                await asyncio.sleep(self.config.poll_every_sec)

    async def _listen_until_lost(self) -> None:
        """LISTEN until the connection ends. A host that vanishes without a reset ends nothing by
        itself: a query every few seconds, with a timeout, finds out (TCP keepalives would too, later),
        and the connection is dropped so that the next one goes through the host list again."""
        lost = asyncio.Event()
        signals = await RunSignals.open(self._dsn, check_timeout_sec=self.config.listen_check_timeout_sec,
                                        on_queued=self._claimer.queued, on_cancel=self._on_cancel, on_lost=lost.set)
        try:
            self._claimer.listening = True
            self._claimer.queued(None)  # whatever was enqueued while nobody listened, whoever's
            while not await wait_event(lost, self.config.listen_check_every_sec):
                await signals.check()
        finally:
            self._claimer.listening = False
            signals.drop()

    def _on_cancel(self, payload: str) -> None:
        """A run was cancelled through the API: stop it now rather than at the next heartbeat. The
        cancel recorded the attempt already; the heartbeat still catches a NOTIFY missed meanwhile."""
        try:
            held = self._running.get(uuid.UUID(str(payload)))
        except ValueError:
            return
        if held is not None:
            run, task = held
            log.info("run %s was cancelled; stopping it", run.run_id, extra=run_fields(run))
            self._taken.add(run.run_id)
            task.cancel()

    async def _execute(self, run: ClaimedRun) -> None:
        handed_on = False  # to the outcome buffer, or to the target that reports the outcome itself
        try:
            try:
                outcome = await self._attempt(run)
            except Exception as exc:  # a bug or a stored task no executor can read: one run fails, not the worker
                failures.set_aside("worker", "run", f"run {run.run_id}", exc)
                outcome = Outcome.failure(f"internal error: {failures.describe(exc)}"[:MAX_ERROR_CHARS])
            if outcome.pending:
                handed_on = True
                self._leases.settle(run)  # its lease is its own (claim_runs), renewed by the target
                self._slots.handed_to_target(run)  # its slots are kept while the run is still running
                log.info("run %s accepted by its target, which reports its outcome itself", run.run_id,
                         extra={"run_id": str(run.run_id), "job_id": str(run.job_id)})
                return
            now = self._clock.now()
            retry_at, error = None, outcome.error
            if outcome.status is RunStatus.FAILED:
                retry = plan_retry(run.retry_policy, run.attempt, now, since=run.scheduled_at)
                retry_at = retry.at
                if retry.past_deadline:
                    error = f"{error}; {retry.past_deadline}" if error else retry.past_deadline
            recorded = Outcome(outcome.status, storable_text(error), storable_text(outcome.output))
            outcomes = self._completer.outcomes
            outcomes.append(Completion(run, recorded, now, retry_at))
            if len(outcomes) == 1:  # the flush loop waits for an outcome only while it has none
                self._to_flush.set()
            handed_on = True
        finally:
            if not handed_on and run.run_id in self._slots.slotted:  # cancelled, taken away or handed back
                self._slots.stopped(run.run_id)
            if not handed_on:
                if run.run_id in self._taken:
                    self._leases.settle(run)
                elif not self._stopping.is_set():  # its cap slots lapsed: stopped, yet still this worker's
                    self._completer.to_give_up.append(run)
                    self._to_flush.set()
                # else the drain hands it back (release), or it waits for its lease to expire
            self._taken.discard(run.run_id)
            self._running.pop(run.run_id, None)
            self._slot_free.set()
            claimer = self._claimer
            if claimer.refill_at:
                claimer.owner_run_ended(run.owner)
            if self._budget is not None:
                if run.priority == Priority.BATCH:
                    self._budget.give_batch()
                self._budget.give()

    async def _attempt(self, run: ClaimedRun) -> Outcome:
        if not run.job_exists or run.task is None:
            return Outcome(RunStatus.CANCELLED, "the job was deleted before this run started")
        prepared = self.guard.ready(run)  # a burst's runs, but for its first: nothing to read, no coroutine
        if prepared is None:
            prepared = await self.guard.prepare(run)  # command permission, secrets, signing secret
        if prepared.refusal is not None or prepared.task is None:
            return Outcome.failure(prepared.refusal or "the task could not be prepared")
        ctx = TaskContext(str(run.run_id), str(run.job_id), run.attempt, run.scheduled_at,
                          float(run.timeout_sec or RUN_TIMEOUT_SEC), signing_secret=prepared.signing_secret,
                          lease_token=str(run.lease_token), owner=run.owner)
        if not tracing.enabled():  # the attempt's span and its handle are left out: this runs for every run
            return await self.executors.run(prepared.task, ctx)
        with tracing.attempt(run, prepared.task.get("type")) as traced:
            outcome = await self.executors.run(prepared.task, ctx)
            traced.outcome("pending" if outcome.pending else outcome.status, outcome.error)
        return outcome

    async def _drain(self) -> None:
        """Give in-flight runs the shutdown grace to finish, then hand the rest back to the queue."""
        deadline = time.monotonic() + self.config.shutdown_grace_sec
        while self._running and time.monotonic() < deadline:
            self._slot_free.clear()
            await wait_event(self._slot_free, deadline - time.monotonic())
        if not self._running:
            return
        left = [run for run, _ in self._running.values()]
        tasks = [task for _, task in self._running.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(*DB_ERRORS):
            handed_back = await self.store.release(left)
            log.info("handed %d unfinished runs back to the queue", len(handed_back))
            for run in left:  # handed back, or already not this worker's
                self._leases.settle(run)

