"""The worker: claims runs, executes them under a heartbeated lease, records every outcome.

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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from chimes import failures, metrics, tracing
from chimes.backoff import plan_retry
from chimes.clock import SYSTEM_CLOCK, Clock
from chimes.enums import Priority, RunStatus
from chimes.logs import run_fields
from chimes.security.storable import storable_text
from chimes.settings import RUN_LEASE_SEC, RUN_TIMEOUT_SEC, SHUTDOWN_GRACE_SEC, WORKER_CONCURRENCY
from chimes.store.cap_slots import CapSlots
from chimes.store.caps import Candidate, Cap, CapKey
from chimes.store.db import DB_ERRORS, Pool
from chimes.store.working import ClaimedRun, Completion, RunSignals, WorkerStore, open_claims_pool
from chimes.timeouts import wait_event
from chimes.worker.budget import SlotBudget
from chimes.worker.caps import admit
from chimes.worker.guard import TaskGuard
from chimes.worker.reporting import report_outcomes
from chimes.worker.tasks.common import MAX_ERROR_CHARS, Outcome, TaskContext
from chimes.worker.tasks.dispatch import Executors
from chimes.worker.tiers import TierPolicy, claim_steps, owner_room

log = logging.getLogger(__name__)
CAPS_RECHECK_SEC = 2.0
#: The longest the poll waits while every claim finds only the runs of owners at their share. Such a
#: claim skips those runs and so reads past every one of them still queued: its cost follows the
#: backlog (``python -m bench skip-claim``, docs/architecture.md).
SKIP_POLL_MAX_SEC = 16.0
# How long the runs whose outcome was refused are given up again at every heartbeat (_give_up_refused):
# past a failover of the database, which takes a failover manager well under a minute.
REFUSED_GIVE_UP_SEC = 300.0
REFUSED_REMEMBERED = 10_000


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


def _also(owners: set[str] | None, named: Iterable[str] | None) -> set[str] | None:
    """``owners`` and those ``named`` (None: any owner's)."""
    return None if owners is None or named is None else owners | set(named)


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Worker:
    def __init__(self, pool: Pool, dsn: str, config: WorkerConfig | None = None,
                 worker_id: str | None = None, executors: Executors | None = None,
                 guard: TaskGuard | None = None, clock: Clock = SYSTEM_CLOCK,
                 budget: SlotBudget | None = None, cap_slots: CapSlots | None = None,
                 shard_id: int | None = None) -> None:
        """``budget``: the slots this worker shares with the process's other claim loops (one per
        shard); without it, ``config.concurrency`` alone bounds it. ``cap_slots``: with a shard map
        that has ranges, the catalog's slots that capped runs take first (docs/scaling.md), and
        ``shard_id`` this worker's home (None: the catalog); without it, caps are counted from the
        running runs of this worker's database, as with one database."""
        self.config = config or WorkerConfig()
        self.store = WorkerStore(pool, worker_id or new_worker_id())
        self.executors = executors or Executors()
        self.guard = guard or TaskGuard(pool, allow_commands=self.config.allow_commands)
        self.completed = 0
        self.listening = False  # whether NOTIFY wakes this worker now (else it polls)
        self._dsn = dsn
        self._clock = clock
        self._running: dict[uuid.UUID, tuple[ClaimedRun, asyncio.Task[None]]] = {}
        self._outcomes: list[Completion] = []
        self._unrecordable: set[uuid.UUID] = set()  # runs whose outcome text the database refused
        self._wake = asyncio.Event()
        self._slot_free = asyncio.Event()
        self._budget = budget
        if budget is not None:
            budget.watch(self._slot_free)
        self._stopping = asyncio.Event()
        self._drained = asyncio.Event()
        self._to_flush = asyncio.Event()  # set with something for the flush loop: an outcome, a slot to free
        self._claim_cycles = 0
        self._claim_asked = 0  # the most runs the last claim could take (within the owners' shares)
        self._skip_owners: list[str] = []  # owners holding their share of this worker (tiers.owner_room)
        # The owners whose runs may be queued beyond what this worker's claims took (None: any owner's):
        # those a NOTIFY named since the last claim that found fewer runs than it asked, and those that
        # claim skipped. While every one of them holds its share of this worker, a claim would skip
        # all their runs, reading past every one of them queued, and find nothing: the claim loop
        # waits until one of them has room for a batch (_refill_at: how many more of each owner's
        # runs are to end first), another owner's runs are queued, or the poll comes round.
        self._maybe_queued: set[str] | None = None
        self._named_since_claim: set[str] | None = set()  # those named since the last claim was sent
        self._refill_at: dict[str, int] = {}
        # Claims in a row that skipped owners at their share and found nothing: the poll backs off with
        # each (_poll_wait), as only a NOTIFY or the poll can bring runs to find.
        self._fruitless_skips = 0
        self._claims_answer = True  # whether this home's last claim answered (else the next reserves one slot)
        self._caps_exist = False
        self._caps_checked_at = -CAPS_RECHECK_SEC
        self._cap_slots = cap_slots
        self._shard_id = shard_id
        self._slotted: set[uuid.UUID] = set()  # runs holding slots in the catalog
        self._slots_to_free: list[uuid.UUID] = []  # their runs left this worker's hands
        self._callbacks: dict[uuid.UUID, ClaimedRun] = {}  # holding slots, their outcome due from the target
        self._slot_deadlines: dict[uuid.UUID, float] = {}  # monotonic: when their slots lapse at the earliest
        # A claim's runs share one lease row (claim_leases): the runs of each claim still in this
        # worker's hands, and the claims none are left of, whose rows the next write deletes.
        self._claims: dict[uuid.UUID, set[uuid.UUID]] = {}
        self._forget: list[uuid.UUID] = []
        self._taken: set[uuid.UUID] = set()  # runs stopped because they are no longer this worker's
        self._to_give_up: list[ClaimedRun] = []  # runs stopped here that are still this worker's
        # Runs whose outcome was refused, by run id: (monotonic time of the refusal, run); _give_up_refused.
        self._refused: dict[uuid.UUID, tuple[float, ClaimedRun]] = {}

    def count_caps_in(self, cap_slots: CapSlots | None) -> None:
        """The shard map gained (or lost) ranges while this worker ran: from its next claim on, capped
        runs take slots in the catalog (None: caps counted from this database's running runs). Runs
        already running hold none, as when a cap is set while they run (docs/scaling.md)."""
        self._cap_slots = cap_slots

    @property
    def worker_id(self) -> str:
        return self.store.worker_id

    def stop(self) -> None:
        """Stop claiming; in-flight runs get the shutdown grace to finish, then are handed back."""
        self._stopping.set()
        self._wake.set()

    async def run(self) -> None:
        log.info("worker %s starting (concurrency %d)", self.worker_id, self.config.concurrency)
        await self.guard.start()  # a secret key that is not the database's stops the worker here
        claims = self.store.claims = await open_claims_pool(self._dsn)
        with contextlib.suppress(*DB_ERRORS):
            await self.store.register(socket.gethostname(), os.getpid(), self.config.concurrency, 0)
        listener = asyncio.create_task(self._listen_loop())
        heartbeat = asyncio.create_task(self._heartbeat_loop())
        flusher = asyncio.create_task(self._flush_loop())
        try:
            await self._claim_loop()
            await self._drain()
        finally:
            heartbeat.cancel()
            listener.cancel()
            # The flusher is never cancelled mid-write (that would lose the batch it holds): it is
            # told to stop and finishes its last flush.
            self._drained.set()
            self._to_flush.set()
            await asyncio.gather(heartbeat, listener, flusher, return_exceptions=True)
            await self._flush()
            with contextlib.suppress(*DB_ERRORS):  # else they are deleted by a reaper once expired
                await self.store.forget_claims(self._forget)
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
                                        on_queued=self._queued, on_cancel=self._on_cancel, on_lost=lost.set)
        try:
            self.listening = True
            self._queued(None)  # whatever was enqueued while nobody listened, whoever's
            while not await wait_event(lost, self.config.listen_check_every_sec):
                await signals.check()
        finally:
            self.listening = False
            signals.drop()

    def _queued(self, owners: frozenset[str] | None) -> None:
        """Runs of ``owners`` were queued (NOTIFY; None: of any owner): the claim loop wakes, unless
        they are all owners that hold their share of this worker already. A claim then would skip
        their runs, scanning past every one of them queued, and find nothing: their runs are claimed
        as theirs end (_refill_at)."""
        self._maybe_queued = _also(self._maybe_queued, owners)
        self._named_since_claim = _also(self._named_since_claim, owners)
        if owners is not None and owners <= self._refill_at.keys():
            return
        self._wake.set()

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

    async def _claim_loop(self) -> None:
        while not self._stopping.is_set():
            free = self.config.concurrency - len(self._running)
            if self._budget is not None:
                free = min(free, self._budget.free())
            if free <= 0:
                self._slot_free.clear()
                await self._slot_free.wait()
                continue
            if self._only_owners_at_share_queued(free):
                # A claim now would skip those owners' runs, scanning past every one of them, and find
                # nothing: it waits until one of them has room for a batch of its own, or runs are queued.
                # Whatever woke the loop meanwhile is in what was just looked at.
                self._wake.clear()
                await self._wait_for_runs()
                continue
            self._wake.clear()
            self._named_since_claim = set()
            limit = min(free, self.config.claim_batch)
            if self._budget is not None:
                # Held until the claim answers, which a hung database delays: never more than a share,
                # and one slot while this home's claims fail (SlotBudget).
                limit = min(limit, self._budget.share() if self._claims_answer else 1)
                self._budget.take(limit)  # reserved across the await: another loop cannot take them too
            claimed: list[ClaimedRun] = []
            try:
                claimed = await self._claim_by_tier(limit)
                self._claims_answer = True
            except Exception as exc:
                self._claims_answer = False
                failures.loop_failed("worker", "claim", exc)
            finally:
                if self._budget is not None:
                    self._budget.give(limit - len(claimed))
            metrics.record_claims(claimed)
            tracing.claimed(claimed, self.worker_id)
            loop = asyncio.get_running_loop()  # its create_task: asyncio.create_task's wrapper is a call more a run
            for run in claimed:
                self._claims.setdefault(run.lease_token, set()).add(run.run_id)
                self._running[run.run_id] = (run, loop.create_task(self._execute(run)))
            if not self._claims_answer or (not self._skip_owners and len(claimed) < self._claim_asked):
                self._fruitless_skips = 0  # no answer, or the queue is empty: the poll keeps its pace
            elif self._skip_owners:
                self._fruitless_skips = 0 if claimed else self._fruitless_skips + 1
            if self._claims_answer and len(claimed) < self._claim_asked:  # none but the skipped owners' left
                self._maybe_queued = _also(set(self._skip_owners), self._named_since_claim)
            if len(claimed) < self._claim_asked:
                await self._wait_for_runs()

    async def _wait_for_runs(self) -> None:
        """Until runs are queued (NOTIFY), an owner at its share has room for a batch (_refill_at), or
        the poll comes round: it finds runs no NOTIFY announced, whoever's they are."""
        if not await wait_event(self._wake, self._poll_wait()):
            self._maybe_queued = None

    def _poll_wait(self) -> float:
        """The poll's wait: ``poll_every_sec``, doubled for each claim in a row that skipped owners at
        their share and found nothing more, up to :data:`SKIP_POLL_MAX_SEC`. Every queued run is
        announced by a NOTIFY, which wakes the loop at once: the poll is for one that was missed, and
        its claim would read past all the skipped owners' queued runs again. Without a LISTEN
        connection the poll is all there is, and it keeps its pace."""
        poll = self.config.poll_every_sec
        if not self.listening or self._fruitless_skips == 0:
            return poll
        return min(poll * (1 << min(self._fruitless_skips - 1, 16)), max(poll, SKIP_POLL_MAX_SEC))

    def _only_owners_at_share_queued(self, free: int) -> bool:
        """Whether some owner holds its share of this worker, and only such owners' runs may be queued
        (_maybe_queued, not None); the ending runs of the owners at their share wake the claim loop."""
        if self._maybe_queued is None:
            return False
        shares = owner_room((run.owner for run, _ in self._running.values()),
                            self.config.tiers.owner_cap(self.config.concurrency), free)
        self._refill_at = shares.refill
        return bool(shares.full) and self._maybe_queued <= self._refill_at.keys()

    def _owner_run_ended(self, owner: str) -> None:
        left = self._refill_at.get(owner)
        if left is None:
            return
        if left > 1:
            self._refill_at[owner] = left - 1
            return
        del self._refill_at[owner]
        self._wake.set()  # room for a batch of its runs: claim them now rather than at the poll

    async def _claim_by_tier(self, limit: int) -> list[ClaimedRun]:
        self._claim_cycles += 1
        # No owner past its share of this worker (tiers.owner_room): a team whose long runs fill the
        # queue leaves slots that another team's runs start in.
        shares = owner_room((run.owner for run, _ in self._running.values()),
                            self.config.tiers.owner_cap(self.config.concurrency), limit)
        limit = self._claim_asked = shares.at_most
        self._skip_owners = shares.full
        self._refill_at = shares.refill
        batch_cap = self.config.tiers.batch_cap(self.config.concurrency)
        if self._budget is None:
            in_batch = sum(1 for run, _ in self._running.values() if run.priority == Priority.BATCH)
            batch_room = max(0, batch_cap - in_batch)
        else:  # the batch share is the process's, across the claim loops of every home
            batch_room = self._budget.take_batch(batch_cap, limit)
        claimed: list[ClaimedRun] = []
        try:
            # A shard's claims are told the catalog's caps, read once a cycle (a round trip to the
            # catalog): a cap set a moment ago holds for every claim after it.
            caps = await self._cap_slots.caps(fresh=True) if self._cap_slots and self._shard_id is not None else []
            for step in claim_steps(self.config.tiers, self._claim_cycles, limit, batch_room):
                room = min(step.at_most, limit - len(claimed))
                if step.lowest == Priority.BATCH:
                    room = min(room, batch_room - sum(1 for run in claimed if run.priority == Priority.BATCH))
                claimed += await self._claim(room, (step.lowest, step.highest), caps)
            if len(claimed) < limit:
                try:
                    if await self._caps_in_force():
                        claimed += await self._claim_capped(limit - len(claimed))
                except DB_ERRORS as exc:
                    if not claimed:
                        raise
                    # With shards the caps live in the catalog, which may fail while this home answers:
                    # the runs claimed above are this worker's now, and must still run.
                    failures.loop_failed("worker", "capped claim", exc)
        finally:
            if self._budget is not None:  # keep the batch runs claimed, give back the rest of the room
                self._budget.settle_batch(batch_room, sum(1 for run in claimed if run.priority == Priority.BATCH))
        return claimed

    async def _claim(self, limit: int, tiers: tuple[Priority, Priority], caps: list[Cap]) -> list[ClaimedRun]:
        """The fast path: runs under no cap. A shard's claim is told the catalog's caps."""
        if caps:
            return await self.store.claim_given_caps(limit, self.config.lease_sec,
                                                     self.config.deadline_grace_sec, caps, tiers, self._skip_owners)
        return await self.store.claim(limit, self.config.lease_sec, self.config.deadline_grace_sec, tiers,
                                      self._skip_owners)

    async def _claim_capped(self, limit: int) -> list[ClaimedRun]:
        skip = frozenset(self._skip_owners)

        def admit_within_shares(candidates: Iterable[Candidate], rooms: Mapping[CapKey, int],
                                at_most: int) -> list[int]:
            return admit((c for c in candidates if c.owner not in skip), rooms, at_most)

        if self._cap_slots is None:
            return await self.store.claim_capped(limit, self.config.lease_sec, self.config.deadline_grace_sec,
                                                 admit_within_shares)
        started = time.monotonic()
        claimed = await self.store.claim_capped_with_slots(limit, self.config.lease_sec,
                                                           self.config.deadline_grace_sec, admit_within_shares,
                                                           self._cap_slots, self._shard_id)
        self._slotted.update(run.run_id for run in claimed)
        self._slot_deadlines.update(dict.fromkeys((run.run_id for run in claimed), started + self.config.lease_sec))
        return claimed

    async def _caps_in_force(self) -> bool:
        """Whether any concurrency cap exists, looked up every few seconds rather than every claim."""
        if self._cap_slots is not None:
            return bool(await self._cap_slots.caps())
        now = time.monotonic()
        if now >= self._caps_checked_at + CAPS_RECHECK_SEC:
            self._caps_exist = await self.store.caps_exist()
            self._caps_checked_at = now
        return self._caps_exist

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
                self._settle(run)  # its lease is its own (claim_runs), renewed by the target
                if run.run_id in self._slotted:  # its slots are kept while the run is still running
                    self._slotted.discard(run.run_id)
                    self._callbacks[run.run_id] = run
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
            self._outcomes.append(Completion(run, recorded, now, retry_at))
            if len(self._outcomes) == 1:  # the flush loop waits for an outcome only while it has none
                self._to_flush.set()
            handed_on = True
        finally:
            if not handed_on and run.run_id in self._slotted:  # cancelled, taken away or handed back
                self._slotted.discard(run.run_id)
                self._slots_to_free.append(run.run_id)
                self._to_flush.set()
            if not handed_on:
                if run.run_id in self._taken:
                    self._settle(run)
                elif not self._stopping.is_set():  # its cap slots lapsed: stopped, yet still this worker's
                    self._to_give_up.append(run)
                    self._to_flush.set()
                # else the drain hands it back (release), or it waits for its lease to expire
            self._taken.discard(run.run_id)
            self._running.pop(run.run_id, None)
            self._slot_free.set()
            if self._refill_at:
                self._owner_run_ended(run.owner)
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

    async def _flush_loop(self) -> None:
        """Outcomes wait up to ``flush_every_sec`` to be written together. An idle worker does not
        wake up for nothing: with none to write the loop waits for the next one."""
        while not self._drained.is_set():
            if not self._outcomes and not self._slots_to_free and not self._to_give_up:
                self._to_flush.clear()
                await self._to_flush.wait()
                continue
            await wait_event(self._drained, self.config.flush_every_sec)
            try:
                await self._flush()
            except Exception as exc:
                failures.loop_failed("worker", "flush", exc)

    def _settle(self, run: ClaimedRun) -> None:
        """``run`` left this worker's hands (recorded, refused, cancelled, taken away, handed back or
        given up): once none of its claim is left, the claim's lease row can go."""
        left = self._claims.get(run.lease_token)
        if left is None:
            return
        left.discard(run.run_id)
        if not left:
            del self._claims[run.lease_token]
            self._forget.append(run.lease_token)

    async def _give_up(self) -> None:
        if not self._to_give_up:
            return
        giving_up, self._to_give_up = self._to_give_up, []
        try:
            await self.store.give_up(giving_up)
        except DB_ERRORS as exc:
            # Tried again with the next flush; meanwhile they are reaped once their claim's lease expires.
            self._to_give_up[:0] = giving_up
            failures.loop_failed("worker", "give up", exc)
            return
        for run in giving_up:
            self._settle(run)

    async def _flush(self) -> None:
        await self._free_slots()
        await self._give_up()
        if not self._outcomes:
            return
        batch, self._outcomes = self._outcomes, []
        forget, self._forget = self._forget, []
        try:
            # One outcome the database refuses must not keep everyone else's from being recorded.
            recorded = await failures.narrow_down(batch, lambda part: self.store.complete(part, forget),
                                                  self._unrecordable_outcome)
        except Exception as exc:
            failures.loop_failed("worker", "flush", exc)
            self._outcomes[:0] = batch  # keep them; the leases are still extended meanwhile
            self._forget[:0] = forget
            return
        if not recorded:
            self._forget[:0] = forget
        accepted = set().union(*recorded)
        self._unrecordable -= accepted
        # Recorded, or refused because the lease was lost: either way this worker runs it no more.
        done = {c.run.run_id for c in batch if c.run.run_id in accepted or c.run.run_id not in self._unrecordable}
        giving_up = {run.run_id for run in self._to_give_up}  # outcomes set aside: still running, still ours
        for completion in batch:
            if completion.run.run_id in done and completion.run.run_id not in giving_up:
                self._settle(completion.run)
        refused_at = time.monotonic()
        for completion in batch:
            if completion.run.run_id in done and completion.run.run_id not in accepted:
                self._refused[completion.run.run_id] = (refused_at, completion.run)
        self._slots_to_free += [run_id for run_id in done if run_id in self._slotted]
        self._slotted -= done
        await self._free_slots()
        self.completed += len(accepted)
        report_outcomes(batch, accepted)
        tracing.completed(batch, accepted)
        for outcome in batch:
            if outcome.run.run_id not in accepted:
                log.warning("outcome of run %s refused: the lease was lost (reaped or cancelled)",
                            outcome.run.run_id, extra=run_fields(outcome.run))

    async def _free_slots(self) -> None:
        """Free the catalog's slots of runs that ended here. When the catalog does not answer, they
        lapse with their lease, no longer renewed: the cap is under-used meanwhile, never exceeded."""
        if self._cap_slots is None or not self._slots_to_free:
            return
        freeing, self._slots_to_free = self._slots_to_free, []
        for run_id in freeing:
            self._slot_deadlines.pop(run_id, None)
        try:
            await self._cap_slots.free(freeing, self.worker_id)
        except DB_ERRORS as exc:
            log.warning("could not free the cap slots of %d runs (%s); they lapse with their lease", len(freeing),
                        failures.describe(exc))

    def _unrecordable_outcome(self, completion: Completion, exc: Exception) -> None:
        """Record the attempt without its text, saying why; an outcome refused even so is given up,
        and its run comes back through the reaper when its lease expires (never lost)."""
        run_id = completion.run.run_id
        if run_id in self._unrecordable:
            self._unrecordable.discard(run_id)
            failures.set_aside("worker", "outcome", f"outcome of run {run_id}", exc)
            self._to_give_up.append(completion.run)
            return
        self._unrecordable.add(run_id)
        log.warning("the outcome of run %s could not be recorded (%s); recording it without its text", run_id,
                    failures.describe(exc), extra=run_fields(completion.run))
        without_text = Outcome(completion.outcome.status,
                               f"the outcome's text could not be stored: {failures.describe(exc)}"[:MAX_ERROR_CHARS])
        self._outcomes.append(Completion(completion.run, without_text, completion.finished_at, completion.retry_at))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_every_sec)
            try:
                await self._heartbeat()
            except Exception as exc:
                failures.loop_failed("worker", "heartbeat", exc)

    async def _heartbeat(self) -> None:
        if self._cap_slots is not None:  # first, and whether this home's database answers or not
            try:
                await self._renew_slots(self._cap_slots)
            except DB_ERRORS as exc:  # this home's leases are still extended below
                failures.loop_failed("worker", "cap slots", exc)
            finally:
                self._stop_runs_losing_their_slots()
        await self.store.register(socket.gethostname(), os.getpid(), self.config.concurrency, len(self._running))
        # Runs whose outcome waits in the buffer still need their lease until it is written.
        held = [run for run, _ in self._running.values()] + [o.run for o in self._outcomes]
        asked = {run.run_id for run in held}
        still_held = await self.store.extend_leases(held, self.config.lease_sec)
        # Only runs this round asked about: one claimed while it waited was not, and is not lost.
        for run_id, (_run, task) in list(self._running.items()):
            if run_id in asked and run_id not in still_held:
                log.warning("run %s was taken away (cancelled or reaped); stopping it", run_id,
                            extra=run_fields(_run))
                self._taken.add(run_id)
                task.cancel()
        await self._give_up_refused()
        # Claims that ended while no outcome was written to take their rows along (a cancel, say).
        forget, self._forget = self._forget, []
        try:
            await self.store.forget_claims(forget)
        except BaseException:
            self._forget[:0] = forget
            raise

    async def _give_up_refused(self) -> None:
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
            await self.store.give_up([run for _, run in kept])

    async def _renew_slots(self, slots: CapSlots) -> None:
        """The slots of the runs this worker runs (or whose outcome waits to be written), and of those
        a target still runs (callback tasks), last another lease; those of callback runs that ended
        are freed with the next flush."""
        renewing = list(self._slotted)
        if self._callbacks:
            try:
                running = await self.store.still_running(list(self._callbacks.values()))
            except DB_ERRORS:  # this home does not answer: keep them while it cannot tell
                running = set(self._callbacks)
            for run_id in [run_id for run_id in self._callbacks if run_id not in running]:
                del self._callbacks[run_id]
                self._slots_to_free.append(run_id)
                self._to_flush.set()
            renewing += running
        started = time.monotonic()
        await slots.renew(renewing, self.worker_id, self.config.lease_sec)
        self._slot_deadlines.update(dict.fromkeys(renewing, started + self.config.lease_sec))

    def _stop_runs_losing_their_slots(self) -> None:
        """A run whose slots could not be renewed (the catalog does not answer) and could lapse before
        the next heartbeat is done is stopped, as one whose lease was lost: after the lapse another
        worker may take the slot, and the cap must not be exceeded. Its run is retried after its
        lease. Half a heartbeat more than one: a heartbeat may come late, and a run may have been
        claimed just before the last one."""
        soon = time.monotonic() + 1.5 * self.config.heartbeat_every_sec
        for run_id, deadline in list(self._slot_deadlines.items()):
            if deadline > soon:
                continue
            del self._slot_deadlines[run_id]
            held = self._running.get(run_id)
            if held is not None:
                log.warning("the cap slots of run %s could not be renewed; stopping it", run_id,
                            extra=run_fields(held[0]))
                held[1].cancel()
            elif self._callbacks.pop(run_id, None) is not None:
                log.warning("the cap slots of run %s, which its target runs, could not be renewed and lapse",
                            run_id)

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
                self._settle(run)

