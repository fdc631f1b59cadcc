"""The worker's parts alone, each given a store of the test's making: the outcomes' flush and the
heartbeat, without a database."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

from chimes.enums import RunStatus
from chimes.store.working import ClaimedRun, Completion
from chimes.worker.completer import Completer
from chimes.worker.heartbeat import Heartbeat
from chimes.worker.leases import ClaimLeases
from chimes.worker.slot_keeper import SlotKeeper
from chimes.worker.tasks.common import Outcome

UNSTORABLE = "text the database refuses"


def claimed(lease_token: uuid.UUID) -> ClaimedRun:
    now = datetime.now(UTC)
    return ClaimedRun(uuid.uuid4(), now, uuid.uuid4(), 1, lease_token, now, "manual", {}, None, None, True)


def done(run: ClaimedRun, output: str = "ok") -> Completion:
    return Completion(run, Outcome(RunStatus.SUCCEEDED, None, output), datetime.now(UTC), None)


class Database:
    """Records outcomes as the runs' database does, but refuses every one that carries
    :data:`UNSTORABLE` (as it refuses text it cannot store), and those of the runs in ``refuse``."""

    def __init__(self, *, refuse: Sequence[uuid.UUID] = (), lost: Sequence[uuid.UUID] = ()) -> None:
        self.refuse = set(refuse)
        self.lost = set(lost)  # runs whose lease the heartbeat finds gone
        self.recorded: dict[uuid.UUID, Outcome] = {}
        self.forgotten: list[uuid.UUID] = []
        self.given_up: list[uuid.UUID] = []
        self.extended: list[uuid.UUID] = []

    @property
    def worker_id(self) -> str:
        return "worker-1"

    async def complete(self, completions: Sequence[Completion], forget: Sequence[uuid.UUID] = ()) -> set[uuid.UUID]:
        if any(c.run.run_id in self.refuse or UNSTORABLE in (c.outcome.output or "") for c in completions):
            raise ValueError("invalid byte sequence")
        for c in completions:
            self.recorded[c.run.run_id] = Outcome(c.outcome.status, c.outcome.error, c.outcome.output)
        self.forgotten += forget
        return {c.run.run_id for c in completions}

    async def give_up(self, runs: Sequence[ClaimedRun]) -> None:
        self.given_up += [run.run_id for run in runs]

    async def still_running(self, runs: Sequence[ClaimedRun]) -> set[uuid.UUID]:
        return {run.run_id for run in runs}

    async def register(self, hostname: str, pid: int, concurrency: int, in_flight: int) -> None:
        pass

    async def extend_leases(self, runs: Sequence[ClaimedRun], lease_sec: float) -> set[uuid.UUID]:
        self.extended += [run.run_id for run in runs]
        return {run.run_id for run in runs if run.run_id not in self.lost}

    async def forget_claims(self, tokens: Sequence[uuid.UUID]) -> None:
        self.forgotten += tokens


def parts(db: Database) -> tuple[ClaimLeases, Completer]:
    to_flush = asyncio.Event()
    leases = ClaimLeases()
    slots = SlotKeeper(db, db.worker_id, None, None, to_flush)
    return leases, Completer(db, leases, slots, to_flush, flush_every_sec=0.02)


def held(leases: ClaimLeases, *runs: ClaimedRun) -> None:
    for run in runs:
        leases.claims.setdefault(run.lease_token, set()).add(run.run_id)


async def test_an_outcome_whose_text_is_refused_is_recorded_without_it_and_the_others_with_theirs() -> None:
    db = Database()
    leases, completer = parts(db)
    claim = uuid.uuid4()
    good, bad, other = claimed(claim), claimed(claim), claimed(claim)
    held(leases, good, bad, other)
    completer.outcomes += [done(good), done(bad, UNSTORABLE), done(other)]

    await completer.flush()
    assert set(db.recorded) == {good.run_id, other.run_id} and completer.completed == 2
    assert leases.claims == {claim: {bad.run_id}}  # the claim's row is kept while one of its runs is unrecorded
    [again] = completer.outcomes
    assert again.run == bad and again.outcome.output is None
    assert again.outcome.error is not None and again.outcome.error.startswith("the outcome's text could not be stored")

    await completer.flush()
    assert db.recorded[bad.run_id].output is None and completer.completed == 3
    assert not completer.outcomes and not leases.claims
    await completer.flush()  # the claim's row goes with the next outcome written, or the heartbeat
    assert db.forgotten == []
    await completer.give_up_refused()
    assert db.given_up == []


async def test_an_outcome_refused_even_without_its_text_is_given_up_and_then_again_at_each_heartbeat() -> None:
    refused = claimed(uuid.uuid4())
    db = Database(refuse=[refused.run_id])
    leases, completer = parts(db)
    held(leases, refused)
    completer.outcomes.append(done(refused))

    await completer.flush()  # refused: tried again without its text
    await completer.flush()  # refused again: set aside, to be given up
    assert completer.to_give_up == [refused] and not completer.outcomes
    await completer.flush()
    assert db.given_up == [refused.run_id] and not leases.claims and completer.completed == 0
    await completer.give_up_refused()  # the write may have committed on a primary since lost (give_up_refused)
    assert db.given_up == [refused.run_id] * 2


async def test_the_heartbeat_stops_the_runs_it_no_longer_holds_and_extends_those_whose_outcome_waits() -> None:
    kept, lost, waiting = claimed(uuid.uuid4()), claimed(uuid.uuid4()), claimed(uuid.uuid4())
    db = Database(lost=[lost.run_id])
    leases, completer = parts(db)
    never = asyncio.Event()
    running = {run.run_id: (run, asyncio.create_task(never.wait())) for run in (kept, lost)}
    completer.outcomes.append(done(waiting))
    taken: set[uuid.UUID] = set()
    heartbeat = Heartbeat(db, every_sec=10, lease_sec=30, concurrency=4, running=running, taken=taken,
                          completer=completer, leases=leases, slots=SlotKeeper(db, db.worker_id, None, None,
                                                                                completer.to_flush))
    try:
        await heartbeat.beat()
        assert sorted(db.extended) == sorted([kept.run_id, lost.run_id, waiting.run_id])
        assert taken == {lost.run_id}
        await asyncio.sleep(0)
        assert running[lost.run_id][1].cancelled() and not running[kept.run_id][1].done()
    finally:
        for _, task in running.values():
            task.cancel()
        await asyncio.gather(*(task for _, task in running.values()), return_exceptions=True)
