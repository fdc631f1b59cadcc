"""The worker's claim loop, and the fairness it keeps: no owner past its share of the worker, the
tiers' turns, and no claim sent while it could only find the runs of owners at their share."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from chimes import failures, metrics, tracing
from chimes.enums import Priority
from chimes.store.caps import Candidate, Cap, CapKey
from chimes.store.db import DB_ERRORS
from chimes.store.working import ClaimedRun
from chimes.timeouts import wait_event
from chimes.worker.budget import SlotBudget
from chimes.worker.caps import admit
from chimes.worker.leases import ClaimLeases
from chimes.worker.slot_keeper import SlotKeeper
from chimes.worker.stores import ClaimStore
from chimes.worker.tiers import claim_steps, owner_room

if TYPE_CHECKING:
    from chimes.worker.worker import WorkerConfig

CAPS_RECHECK_SEC = 2.0
#: The longest the poll waits while every claim finds only the runs of owners at their share. Such a
#: claim skips those runs and so reads past every one of them still queued: its cost follows the
#: backlog (``python -m bench skip-claim``, docs/architecture.md).
SKIP_POLL_MAX_SEC = 16.0

Running = dict[uuid.UUID, tuple[ClaimedRun, asyncio.Task[None]]]


def _also(owners: set[str] | None, named: Iterable[str] | None) -> set[str] | None:
    """``owners`` and those ``named`` (None: any owner's)."""
    return None if owners is None or named is None else owners | set(named)


class Claimer:
    def __init__(self, store: ClaimStore, config: WorkerConfig, *, running: Running, leases: ClaimLeases,
                 slots: SlotKeeper, budget: SlotBudget | None, slot_free: asyncio.Event, stopping: asyncio.Event,
                 execute: Callable[[ClaimedRun], Coroutine[Any, Any, None]]) -> None:
        """``running``: the worker's runs in flight, to which the loop adds each run it claims, started
        with ``execute``. ``slot_free``: set when a run ends; ``stopping``: set when the worker stops
        claiming."""
        self._store = store
        self._config = config
        self._running = running
        self._leases = leases
        self._slots = slots
        self._budget = budget
        self._slot_free = slot_free
        self._stopping = stopping
        self._execute = execute
        self.listening = False  # whether NOTIFY wakes this worker now (else it polls)
        self.wake = asyncio.Event()
        self._claim_cycles = 0
        self._claim_asked = 0  # the most runs the last claim could take (within the owners' shares)
        self.skip_owners: list[str] = []  # owners holding their share of this worker (tiers.owner_room)
        # The owners whose runs may be queued beyond what this worker's claims took (None: any owner's):
        # those a NOTIFY named since the last claim that found fewer runs than it asked, and those that
        # claim skipped. While every one of them holds its share of this worker, a claim would skip
        # all their runs, reading past every one of them queued, and find nothing: the claim loop
        # waits until one of them has room for a batch (refill_at: how many more of each owner's
        # runs are to end first), another owner's runs are queued, or the poll comes round.
        self.maybe_queued: set[str] | None = None
        self._named_since_claim: set[str] | None = set()  # those named since the last claim was sent
        self.refill_at: dict[str, int] = {}
        # Claims in a row that skipped owners at their share and found nothing: the poll backs off with
        # each (poll_wait), as only a NOTIFY or the poll can bring runs to find.
        self._fruitless_skips = 0
        self._claims_answer = True  # whether this home's last claim answered (else the next reserves one slot)
        self._caps_exist = False
        self._caps_checked_at = -CAPS_RECHECK_SEC

    def queued(self, owners: frozenset[str] | None) -> None:
        """Runs of ``owners`` were queued (NOTIFY; None: of any owner): the claim loop wakes, unless
        they are all owners that hold their share of this worker already. A claim then would skip
        their runs, scanning past every one of them queued, and find nothing: their runs are claimed
        as theirs end (refill_at)."""
        self.maybe_queued = _also(self.maybe_queued, owners)
        self._named_since_claim = _also(self._named_since_claim, owners)
        if owners is not None and owners <= self.refill_at.keys():
            return
        self.wake.set()

    async def loop(self) -> None:
        while not self._stopping.is_set():
            free = self._config.concurrency - len(self._running)
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
                self.wake.clear()
                await self._wait_for_runs()
                continue
            self.wake.clear()
            self._named_since_claim = set()
            limit = min(free, self._config.claim_batch)
            if self._budget is not None:
                # Held until the claim answers, which a hung database delays: never more than a share,
                # and one slot while this home's claims fail (SlotBudget).
                limit = min(limit, self._budget.share() if self._claims_answer else 1)
                self._budget.take(limit)  # reserved across the await: another loop cannot take them too
            claimed: list[ClaimedRun] = []
            try:
                claimed = await self.claim_by_tier(limit)
                self._claims_answer = True
            except Exception as exc:
                self._claims_answer = False
                failures.loop_failed("worker", "claim", exc)
            finally:
                if self._budget is not None:
                    self._budget.give(limit - len(claimed))
            metrics.record_claims(claimed)
            tracing.claimed(claimed, self._store.worker_id)
            loop = asyncio.get_running_loop()  # its create_task: asyncio.create_task's wrapper is a call more a run
            claims, running, execute = self._leases.claims, self._running, self._execute
            for run in claimed:
                claims.setdefault(run.lease_token, set()).add(run.run_id)
                running[run.run_id] = (run, loop.create_task(execute(run)))
            if not self._claims_answer or (not self.skip_owners and len(claimed) < self._claim_asked):
                self._fruitless_skips = 0  # no answer, or the queue is empty: the poll keeps its pace
            elif self.skip_owners:
                self._fruitless_skips = 0 if claimed else self._fruitless_skips + 1
            if self._claims_answer and len(claimed) < self._claim_asked:  # none but the skipped owners' left
                self.maybe_queued = _also(set(self.skip_owners), self._named_since_claim)
            if len(claimed) < self._claim_asked:
                await self._wait_for_runs()

    async def _wait_for_runs(self) -> None:
        """Until runs are queued (NOTIFY), an owner at its share has room for a batch (refill_at), or
        the poll comes round: it finds runs no NOTIFY announced, whoever's they are."""
        if not await wait_event(self.wake, self.poll_wait()):
            self.maybe_queued = None

    def poll_wait(self) -> float:
        """The poll's wait: ``poll_every_sec``, doubled for each claim in a row that skipped owners at
        their share and found nothing more, up to :data:`SKIP_POLL_MAX_SEC`. Every queued run is
        announced by a NOTIFY, which wakes the loop at once: the poll is for one that was missed, and
        its claim would read past all the skipped owners' queued runs again. Without a LISTEN
        connection the poll is all there is, and it keeps its pace."""
        poll = self._config.poll_every_sec
        if not self.listening or self._fruitless_skips == 0:
            return poll
        return min(poll * (1 << min(self._fruitless_skips - 1, 16)), max(poll, SKIP_POLL_MAX_SEC))

    def _only_owners_at_share_queued(self, free: int) -> bool:
        """Whether some owner holds its share of this worker, and only such owners' runs may be queued
        (maybe_queued, not None); the ending runs of the owners at their share wake the claim loop."""
        if self.maybe_queued is None:
            return False
        shares = owner_room((run.owner for run, _ in self._running.values()),
                            self._config.tiers.owner_cap(self._config.concurrency), free)
        self.refill_at = shares.refill
        return bool(shares.full) and self.maybe_queued <= self.refill_at.keys()

    def owner_run_ended(self, owner: str) -> None:
        """A run of ``owner`` ended (the worker asks only while :attr:`refill_at` has owners)."""
        left = self.refill_at.get(owner)
        if left is None:
            return
        if left > 1:
            self.refill_at[owner] = left - 1
            return
        del self.refill_at[owner]
        self.wake.set()  # room for a batch of its runs: claim them now rather than at the poll

    async def claim_by_tier(self, limit: int) -> list[ClaimedRun]:
        self._claim_cycles += 1
        # No owner past its share of this worker (tiers.owner_room): a team whose long runs fill the
        # queue leaves slots that another team's runs start in.
        shares = owner_room((run.owner for run, _ in self._running.values()),
                            self._config.tiers.owner_cap(self._config.concurrency), limit)
        limit = self._claim_asked = shares.at_most
        self.skip_owners = shares.full
        self.refill_at = shares.refill
        batch_cap = self._config.tiers.batch_cap(self._config.concurrency)
        if self._budget is None:
            in_batch = sum(1 for run, _ in self._running.values() if run.priority == Priority.BATCH)
            batch_room = max(0, batch_cap - in_batch)
        else:  # the batch share is the process's, across the claim loops of every home
            batch_room = self._budget.take_batch(batch_cap, limit)
        claimed: list[ClaimedRun] = []
        try:
            # A shard's claims are told the catalog's caps, read once a cycle (a round trip to the
            # catalog): a cap set a moment ago holds for every claim after it.
            cap_slots = self._slots.cap_slots
            caps = await cap_slots.caps(fresh=True) if cap_slots and self._slots.shard_id is not None else []
            for step in claim_steps(self._config.tiers, self._claim_cycles, limit, batch_room):
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
            return await self._store.claim_given_caps(limit, self._config.lease_sec,
                                                      self._config.deadline_grace_sec, caps, tiers, self.skip_owners)
        return await self._store.claim(limit, self._config.lease_sec, self._config.deadline_grace_sec, tiers,
                                       self.skip_owners)

    async def _claim_capped(self, limit: int) -> list[ClaimedRun]:
        skip = frozenset(self.skip_owners)

        def admit_within_shares(candidates: Iterable[Candidate], rooms: Mapping[CapKey, int],
                                at_most: int) -> list[int]:
            return admit((c for c in candidates if c.owner not in skip), rooms, at_most)

        cap_slots = self._slots.cap_slots
        if cap_slots is None:
            return await self._store.claim_capped(limit, self._config.lease_sec, self._config.deadline_grace_sec,
                                                  admit_within_shares)
        started = time.monotonic()
        claimed = await self._store.claim_capped_with_slots(limit, self._config.lease_sec,
                                                            self._config.deadline_grace_sec, admit_within_shares,
                                                            cap_slots, self._slots.shard_id)
        self._slots.took(claimed, started, self._config.lease_sec)
        return claimed

    async def _caps_in_force(self) -> bool:
        """Whether any concurrency cap exists, looked up every few seconds rather than every claim."""
        cap_slots = self._slots.cap_slots
        if cap_slots is not None:
            return bool(await cap_slots.caps())
        now = time.monotonic()
        if now >= self._caps_checked_at + CAPS_RECHECK_SEC:
            self._caps_exist = await self._store.caps_exist()
            self._caps_checked_at = now
        return self._caps_exist
