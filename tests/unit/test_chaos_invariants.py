"""The chaos invariant checker on hand-made evidence: each check passes a sound history and catches the
broken one it exists for (a lost slot, a stale worker's outcome, a fire from a lost lease, ...)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from chimes.ids import run_id_for
from chimes_chaos.evidence import Evidence
from chimes_chaos.faults import FaultWindow
from chimes_chaos.fleet import Exit, FleetShape
from chimes_chaos.invariants import check_all, check_slots
from chimes_chaos.moves import ACTIONS, MoveWindow, movable_blocks, plan_moves
from chimes_chaos.observer import LeaseObserver
from chimes_chaos.target import Delivery
from chimes_chaos.workload import Answer, ChaosJob

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
JOB = ChaosJob(uuid.UUID("01936b2e-0000-7000-8000-000000000001"), "every-2s", "allow", "*/2 * * * * *", T0)
PARTITION = 7


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


class History:
    """A sound history of JOB's first slots (one attempt each, answered 200), to break on purpose."""

    def __init__(self, slots: int = 3) -> None:
        self.runs: list[dict[str, Any]] = []
        self.attempts: dict[uuid.UUID, list[dict[str, Any]]] = {}
        self.deliveries: list[Delivery] = []
        self.slots: dict[uuid.UUID, datetime] = {}
        for n in range(slots):
            slot = at(2 * n)
            run_id = run_id_for(JOB.job_id, slot)
            self.slots[run_id] = slot
            ms = timedelta(milliseconds=1)
            self.runs.append({"run_id": run_id, "scheduled_at": slot, "job_id": JOB.job_id,
                              "partition_id": PARTITION, "trigger": "schedule", "status": "succeeded", "attempt": 1,
                              "fired_at": slot + 5 * ms, "created_at": slot + 6 * ms, "started_at": slot + 20 * ms,
                              "finished_at": slot + 40 * ms, "worker_id": "worker-1", "reason": None})
            number = self.deliver(run_id, 1, "200", token=f"token-{n}")
            self.attempts[run_id] = [self.attempt(run_id, 1, "succeeded", slot + timedelta(milliseconds=20),
                                                  slot + timedelta(milliseconds=40), number)]

    def deliver(self, run_id: uuid.UUID, attempt: int, answer: str, token: str = "token",
                key: str | None = None) -> int:
        number = len(self.deliveries) + 1
        received = self.slots.get(run_id, T0) + timedelta(milliseconds=30 * attempt)
        self.deliveries.append(Delivery(number, "/job/0", str(run_id), attempt, key or str(run_id), token,
                                        received.timestamp(), answer))
        return number

    @staticmethod
    def attempt(run_id: uuid.UUID, attempt: int, status: str, started: datetime, finished: datetime,
                delivery: int | None, worker: str = "worker-1", error: str | None = None) -> dict[str, Any]:
        output = None if delivery is None else f'{{"delivery": {delivery}, "answer": 200}}'
        return {"run_id": run_id, "attempt": attempt, "worker_id": worker, "status": status, "started_at": started,
                "finished_at": finished, "error": error, "output": output}

    def evidence(self, faults: list[FaultWindow] | None = None, leases: LeaseObserver | None = None,
                 unfinished: list[dict[str, Any]] | None = None, check_end: datetime | None = None) -> Evidence:
        return Evidence({JOB.job_id: JOB}, self.runs, self.attempts, unfinished or [], self.deliveries, faults or [],
                        [], leases or LeaseObserver(""), FleetShape(), T0, at(60), check_end or at(4))


def invariants(ev: Evidence) -> list[int]:
    return sorted(v.invariant for v in check_all(ev))


def test_a_sound_history_has_no_violation() -> None:
    ev = History().evidence()
    assert check_all(ev) == []
    assert ev.figures["slots_checked"] == 3


def test_a_lost_slot_a_doubled_slot_and_a_foreign_run_are_caught() -> None:
    history = History()
    lost = history.runs.pop(1)
    history.runs.append(dict(history.runs[0], run_id=uuid.uuid4()))  # a second record for slot 0
    history.runs.append(dict(lost, run_id=run_id_for(JOB.job_id, at(3)), scheduled_at=at(3)))  # not a slot
    found = check_slots(history.evidence())
    assert [v.invariant for v in found] == [1, 1, 1]
    assert any("no run record" in v.what for v in found)
    assert any("2 run records" in v.what for v in found)
    assert any("not a slot of the job" in v.what for v in found)


def test_a_skipped_slot_is_a_violation_unless_a_skip_job_had_a_run_active() -> None:
    history = History()
    history.runs[1].update(status="skipped", reason="skipped: the previous run is still active (concurrency skip)")
    history.attempts.pop(history.runs[1]["run_id"])
    history.deliveries = [d for d in history.deliveries if d.run_id != str(history.runs[1]["run_id"])]
    assert invariants(history.evidence()) == [1]
    skip_job = ChaosJob(JOB.job_id, JOB.name, "skip", JOB.cron, JOB.first_slot)
    ev = history.evidence()
    ev.jobs = {JOB.job_id: skip_job}
    assert check_all(ev) == []


def test_a_run_left_scheduled_with_nothing_to_move_it_is_caught() -> None:
    stranded = {"run_id": uuid.uuid4(), "status": "scheduled", "attempt": 2, "lease_live": None, "queued": False,
                "retry_pending": False, "held": False}
    waiting = dict(stranded, run_id=uuid.uuid4(), retry_pending=True)
    found = check_all(History().evidence(unfinished=[stranded, waiting]))
    assert [v.invariant for v in found] == [2]
    assert str(stranded["run_id"]) in found[0].what


def test_a_success_the_target_never_answered_and_a_changed_key_are_caught() -> None:
    history = History()
    history.deliveries[0] = Delivery(1, "/job/0", history.deliveries[0].run_id, 1, history.deliveries[0].run_id,
                                     "token-0", T0.timestamp(), "500")
    history.attempts[history.runs[0]["run_id"]][0]["output"] = None  # recorded without an answer body
    other = history.runs[1]["run_id"]
    history.deliver(other, 1, "200", token="token-1", key="another-key")
    found = check_all(history.evidence())
    assert [v.invariant for v in found] == [3, 3]
    assert any("never answered that attempt with a success" in v.what for v in found)
    assert any("Idempotency-Keys" in v.what for v in found)


def test_a_stale_workers_success_written_over_a_newer_attempt_is_caught() -> None:
    """Worker-1 was frozen past its lease during attempt 1; the reaper gave attempt 2 to worker-2.
    If worker-1's late success were accepted, it would be recorded as attempt 2 from delivery 1."""
    history = History(slots=1)
    run = history.runs[0]
    run_id = run["run_id"]
    slot = run["scheduled_at"]
    history.deliver(run_id, 2, "200", token="token-of-worker-2")
    history.attempts[run_id] = [
        History.attempt(run_id, 1, "failed", slot, slot + timedelta(seconds=6), None,
                        error="worker worker-1 stopped heartbeating during attempt 1 (lease expired)"),
        History.attempt(run_id, 2, "succeeded", slot + timedelta(seconds=6.1), slot + timedelta(seconds=7), 1),
    ]
    run.update(attempt=2, worker_id="worker-2")
    found = check_all(history.evidence(check_end=at(0)))
    assert {v.invariant for v in found} == {4}
    assert any("recorded from delivery 1, which was run" in v.what for v in found)
    assert any("its success recorded by worker-1" in v.what for v in found)


def test_an_attempt_history_out_of_order_is_caught() -> None:
    history = History(slots=1)
    run_id = history.runs[0]["run_id"]
    slot = history.runs[0]["scheduled_at"]
    number = history.deliver(run_id, 2, "200")
    history.attempts[run_id] = [
        History.attempt(run_id, 1, "succeeded", slot, slot + timedelta(seconds=2), 1),
        History.attempt(run_id, 2, "succeeded", slot + timedelta(seconds=1), slot + timedelta(seconds=3), number),
    ]
    history.runs[0]["attempt"] = 2
    found = [v.what for v in check_all(history.evidence(check_end=at(0)))]
    assert any("succeeded and yet the run was attempted again" in what for what in found)
    assert any("attempt 2 started" in what for what in found)


def test_one_attempt_delivered_under_two_lease_tokens_is_caught() -> None:
    history = History(slots=1)
    history.deliver(history.runs[0]["run_id"], 1, "500", token="a-second-claim")
    found = check_all(history.evidence(check_end=at(0)))
    assert [v.invariant for v in found] == [4]
    assert "2 lease tokens" in found[0].what


def lease_history(*rows: tuple[float, str | None, int, float]) -> LeaseObserver:
    """Observations of PARTITION: (seen, owner, token, expires) with times in seconds after T0."""
    observer = LeaseObserver("")
    for seen, owner, token, expires in rows:
        observer.observe([{"seen": at(seen), "partition_id": PARTITION, "owner": owner, "token": token,
                           "expires_at": at(expires)}])
    return observer


def test_a_fire_written_after_its_lease_was_taken_over_is_caught() -> None:
    leases = lease_history((-1, "node-a", 1, 2), (0.5, "node-a", 1, 3), (4.0, "node-b", 2, 7), (5.0, "node-b", 2, 8))
    history = History(slots=3)
    history.runs[0].update(fired_at=at(0.2), created_at=at(4.5))  # prepared under token 1, written under 2
    history.runs[2].update(fired_at=at(4.2), created_at=at(4.3))  # node-b's own fire: fine
    found = check_all(history.evidence(leases=leases))
    assert [v.invariant for v in found] == [4]
    assert "token 1 of node-a" in found[0].what


def test_the_observer_keeps_a_span_per_token_and_ends_it_on_release_or_takeover() -> None:
    leases = lease_history((0, "node-a", 1, 3), (1, "node-a", 1, 4), (5, "node-a", 1, 4), (6, "node-a", 1, 9),
                           (7, None, 1, -1), (8, "node-b", 2, 11))
    first, second = leases.spans[PARTITION]
    assert (first.token, first.owner, first.first_seen, first.last_valid, first.ended_seen) == (
        1, "node-a", at(0), at(6), at(7))  # expired at 5 but renewed at 6: still the same span
    assert (second.token, second.owner, second.ended_seen) == (2, "node-b", None)
    assert leases.held_at("node-a", at(3)) == {PARTITION: first}
    assert leases.held_at("node-a", at(7.5)) == {}
    assert leases.next_span(first) is second


def test_a_slow_takeover_after_a_clean_node_loss_is_caught() -> None:
    leases = lease_history((-2, "node-a", 1, 1), (-0.1, "node-a", 1, 2.9), (3.5, "node-b", 2, 6.5))
    loss = FaultWindow("kill_scheduler", "node-a", at(0).timestamp(), at(2).timestamp())
    history = History(slots=4)
    history.runs[1].update(fired_at=at(3.6), created_at=at(3.6))  # slot 2 s: fired 3.6 s after the loss
    ev = history.evidence(faults=[loss], leases=leases, check_end=at(6))
    assert check_all(ev) == []
    assert ev.figures["takeover"]["fires_resumed_sec"] == {"n": 1, "p50": 3.6, "p99": 3.6, "max": 3.6}
    history.runs[1].update(fired_at=at(9), created_at=at(9))
    slow = check_all(history.evidence(faults=[loss], leases=leases, check_end=at(6)))
    assert [v.invariant for v in slow] == [5]
    nearby = FaultWindow("freeze_scheduler", "node-c", at(1).timestamp(), at(6).timestamp())
    excused = history.evidence(faults=[loss, nearby], leases=leases, check_end=at(6))
    assert check_all(excused) == []  # two nodes lost at once: measured, not bounded
    zone = FaultWindow("cut_primary_zone", "zone-2", at(1).timestamp(), at(6).timestamp())
    assert check_all(history.evidence(faults=[loss, zone], leases=leases, check_end=at(6))) == []  # nor a zone


def test_start_lag_is_bounded_only_for_runs_that_waited_outside_faults() -> None:
    history = History(slots=30)
    for run in history.runs[:3]:
        run_id = run["run_id"]
        history.attempts[run_id][0]["started_at"] = run["scheduled_at"] + timedelta(seconds=5)
        history.attempts[run_id][0]["finished_at"] = run["scheduled_at"] + timedelta(seconds=6)
    ev = history.evidence(check_end=at(58))
    assert [v.invariant for v in check_all(ev)] == [6]
    assert ev.figures["start_lag_outside_faults_sec"]["max"] == 5.0
    restart = FaultWindow("restart_postgres_immediate", None, at(3).timestamp(), at(4).timestamp())
    excused = history.evidence(faults=[restart], check_end=at(58))
    assert check_all(excused) == []
    assert excused.figures["start_lag_inside_faults_sec"]["n"] == 5  # slots 0..8: the restart, then 5 s settling


def test_a_process_that_exits_is_caught_even_while_starting_during_a_database_restart() -> None:
    restart = FaultWindow("restart_postgres_fast", None, at(100).timestamp(), at(102).timestamp())
    could_not_start = Exit("worker-2", 1, at(99).timestamp(), at(101).timestamp(), "CannotConnectNowError: ...")
    crashed = Exit("worker-1", 1, at(0).timestamp(), at(101).timestamp(), "Traceback ...\nInternalClientError: ...")
    ev = History().evidence(faults=[restart])
    ev.exits = [could_not_start, crashed]
    found = check_all(ev)
    assert [v.invariant for v in found] == [7, 7]
    assert "worker-2 exited with code 1 after 2 s: CannotConnectNowError" in found[0].what
    assert "worker-1 exited with code 1 after 101 s: InternalClientError" in found[1].what



def test_a_job_acknowledged_but_missing_after_a_failover_is_caught() -> None:
    ev = History().evidence()
    ev.jobs_found = set()
    assert invariants(ev) == [8]
    ev = History().evidence()
    ev.jobs_found = {JOB.job_id}
    assert invariants(ev) == []


def test_an_acknowledged_edit_lost_after_a_failover_is_caught() -> None:
    for acknowledged, held, caught in ((41, 41, False), (41, 42, False), (41, 40, True), (41, None, True),
                                       (-1, None, False)):
        ev = History().evidence()
        ev.probe = (acknowledged, held)
        assert invariants(ev) == ([8] if caught else []), (acknowledged, held)


def test_an_answer_other_than_success_429_or_503_is_caught() -> None:
    ev = History().evidence()
    ev.answers = [Answer("probe", 1.0, 1.2, 200), Answer("create", 2.0, 2.1, 201), Answer("probe", 3.0, 18.0, 503),
                  Answer("create", 4.0, 4.1, 429)]
    assert invariants(ev) == []
    assert ev.figures["api_answers"] == {"200": 1, "201": 1, "429": 1, "503": 1}
    ev.answers += [Answer("probe", 5.0, 5.1, 500, "internal error"), Answer("probe", 6.0, 31.0, None, "timeout")]
    assert invariants(ev) == [9, 9]


def test_a_delivery_before_its_slot_by_the_host_clock_is_caught() -> None:
    history = History()
    early = history.deliveries[1]
    history.deliveries[1] = Delivery(early.number, early.path, early.run_id, early.attempt, early.idempotency_key,
                                     early.lease_token, at(2).timestamp() - 0.5, early.answer)
    assert invariants(history.evidence()) == [10]


def test_failover_figures_time_each_move_of_the_primary_to_the_first_fire_claim_and_write() -> None:
    history = History(slots=10)
    moved = FaultWindow("kill_postgres_primary", "pg1", at(1).timestamp(), at(15).timestamp(),
                        promoted=at(5).timestamp())
    ev = history.evidence(faults=[moved], check_end=at(18))
    ev.answers = [Answer("probe", at(4).timestamp(), at(4.5).timestamp(), 503),
                  Answer("probe", at(5).timestamp(), at(5.5).timestamp(), 200)]
    check_all(ev)
    figures = ev.figures["failovers"]
    assert figures["primary_moves"] == {"kill_postgres_primary": 1}
    assert figures["loss_to_new_primary_sec"]["max"] == 4.0
    assert figures["loss_to_first_fire_sec"]["max"] == 5.006  # the slot at 6 s, written 6 ms after it
    assert figures["loss_to_first_claim_sec"]["max"] == 5.02
    assert figures["loss_to_first_write_sec"]["max"] == 4.5


def test_a_shard_stop_excuses_only_its_own_home_and_other_homes_must_start_on_time() -> None:
    """JOB's partition lives on the catalog (home 0); a stop of shard-1 is no fault window for it:
    its runs that waited meanwhile are the blast radius, bounded like any healthy run (11)."""
    history = History(slots=30)
    homes = [0] * 1024
    homes[PARTITION + 1:] = [1] * (1024 - PARTITION - 1)
    stop = FaultWindow("stop_postgres_shard", "shard-1", at(10).timestamp(), at(24).timestamp())
    ev = history.evidence(faults=[stop], check_end=at(58))
    ev.home_of = homes
    assert check_all(ev) == []
    stops = ev.figures["shard_stops"]
    assert stops["stops"] == 1 and stops["start_lag_other_homes_sec"]["n"] == 10  # slots 10..28: stop + 5 s
    assert stops["start_lag_stopped_home_sec"]["n"] == 0
    for run in history.runs[5:15]:  # the catalog's runs while the shard was stopped: held up by it
        history.attempts[run["run_id"]][0]["started_at"] = run["scheduled_at"] + timedelta(seconds=8)
        history.attempts[run["run_id"]][0]["finished_at"] = run["scheduled_at"] + timedelta(seconds=9)
    ev = history.evidence(faults=[stop], check_end=at(58))
    ev.home_of = homes
    assert sorted({v.invariant for v in check_all(ev)}) == [6, 11]
    # Had the stop hit JOB's own home, the same late starts are its catch-up, not a violation.
    ev = history.evidence(faults=[stop], check_end=at(58))
    ev.home_of = [1] * 1024
    assert check_all(ev) == []
    assert ev.figures["shard_stops"]["start_lag_stopped_home_sec"]["max"] == 8.0


def moved_to_shard(cut_over: float, started: float | None = None, ended: float | None = None) -> MoveWindow:
    """PARTITION's range moved from the catalog to shard-1, cut over at ``cut_over`` s after T0."""
    return MoveWindow(0, 511, 0, 1, "left_alone", at(cut_over - 1 if started is None else started).timestamp(),
                      at(cut_over + 0.5 if ended is None else ended).timestamp(), move_id=1, outcome="done",
                      cut_over_at=at(cut_over).timestamp())


def with_moves(ev: Evidence, *moves: MoveWindow, lease_homes: list[LeaseObserver] | None = None) -> Evidence:
    ev.home_of = [1] * 512 + [1] * 512
    ev.first_home_of = [0] * 512 + [1] * 512
    ev.moves = list(moves)
    ev.lease_homes = lease_homes or [LeaseObserver(""), LeaseObserver("", home=1)]
    return ev


def test_a_job_or_run_left_on_a_home_the_map_does_not_give_it_is_caught() -> None:
    history = History(slots=3)
    ev = with_moves(history.evidence(), moved_to_shard(1.0))
    ev.placement = {JOB.job_id: ("job", PARTITION, {1})} | {r["run_id"]: ("run", PARTITION, {1}) for r in history.runs}
    assert check_all(ev) == []
    assert ev.figures["rows_placed"] == 4
    stray = history.runs[0]["run_id"]
    ev.placement[stray] = ("run", PARTITION, {0, 1})  # the source kept its copy
    ev.placement[JOB.job_id] = ("job", PARTITION, {0})  # the job never reached the target
    found = check_all(ev)
    assert [v.invariant for v in found] == [12, 12]
    assert any(f"run {stray} (partition {PARTITION}) is on catalog and shard-1" in v.what for v in found)


def test_the_fence_check_reads_the_leases_of_the_home_that_held_the_partition_when_the_run_was_written() -> None:
    """Before the cut-over (at 3 s) PARTITION lives on the catalog, after it on shard-1. A run written
    at 4.5 s on shard-1 is judged by shard-1's lease rows alone: a takeover on the catalog, which no
    longer holds the partition, says nothing about it; one on shard-1 does."""
    catalog = lease_history((-1, "node-a", 1, 2), (0.5, "node-a", 1, 3), (4.0, "node-b", 2, 7))
    shard = lease_history((3.2, "node-a", 5, 6))
    shard.home = 1
    for span in shard.spans[PARTITION]:
        span.home = 1
    history = History(slots=3)
    history.runs[0].update(fired_at=at(0.2), created_at=at(4.5))
    ev = with_moves(history.evidence(), moved_to_shard(3.0), lease_homes=[catalog, shard])
    assert check_all(ev) == []
    taken_over = lease_history((3.2, "node-a", 5, 6), (4.0, "node-b", 6, 9))
    for span in taken_over.spans[PARTITION]:
        span.home = 1
    ev = with_moves(history.evidence(), moved_to_shard(3.0), lease_homes=[catalog, taken_over])
    assert [v.invariant for v in check_all(ev)] == [4]
    assert ev.home_at(PARTITION, at(2.9)) == 0 and ev.home_at(PARTITION, at(3.0)) == 1


def test_a_move_excuses_the_start_lag_of_its_own_range_alone() -> None:
    history = History(slots=30)
    for run in history.runs[5:10]:  # waited while the range was fenced
        history.attempts[run["run_id"]][0]["started_at"] = run["scheduled_at"] + timedelta(seconds=4)
        history.attempts[run["run_id"]][0]["finished_at"] = run["scheduled_at"] + timedelta(seconds=5)
    move = moved_to_shard(18.0, started=10.0, ended=19.0)
    assert check_all(with_moves(history.evidence(check_end=at(58)), move)) == []
    elsewhere = MoveWindow(768, 1023, 1, 0, "left_alone", at(10).timestamp(), at(19).timestamp(), move_id=1,
                           outcome="cancelled")
    ev = with_moves(history.evidence(check_end=at(58)), elsewhere)
    ev.home_of = ev.first_home_of
    assert [v.invariant for v in check_all(ev)] == [6]


def test_the_move_plan_is_replayed_by_its_seed_and_moves_the_upper_half_of_each_home() -> None:
    assert plan_moves(4, 50, 2) == plan_moves(4, 50, 2) != plan_moves(5, 50, 2)
    assert {m.action for m in plan_moves(4, 50, 2)} == set(ACTIONS)
    assert {m.block for m in plan_moves(4, 50, 2)} == {0, 1}
    assert movable_blocks([(0, 511), (512, 1023)]) == [(256, 511), (768, 1023)]
