"""The invariant checker: what must hold after a chaos run, read from the database and the target's log.

Each check returns the violations it found (none is the goal) and leaves its figures in
``evidence.figures``. The checks are written so that they fail if the property they guard is
broken: they compare independent records (the schedule, the runs table, the attempts table, the
target's log of calls, the leases the harness saw) rather than trusting one of them.
"""

from __future__ import annotations

import itertools
import uuid
from collections import Counter, defaultdict
from datetime import datetime, timedelta
from typing import Any

from chimes_chaos.evidence import Evidence, Violation
from chimes_chaos.failover import check_failovers
from chimes_chaos.target import Delivery, delivery_number
from chimes_chaos.timing import check_start_lag, check_takeovers

INVARIANTS = {
    1: "every fire the schedules imply has exactly one run record",
    2: "every run ended, or is provably still in flight",
    3: "every succeeded run was delivered; all deliveries of a run carry its one Idempotency-Key",
    4: "no status written by a worker or node after it lost its lease survived",
    5: "a lost node's partitions fired again within the lease TTL plus one scan",
    6: "start lag p99 within 2 s outside fault windows",
    7: "no process exited on its own",
    8: "nothing acknowledged was lost: every job answered 201 exists, the last edit answered 200 holds",
    9: "the API answered every write with 2xx, 429 or 503 (never another error, never silence)",
    10: "no run reached the target before its slot, by the host's clock",
    11: "while a shard's PostgreSQL was stopped, the other homes' runs started on time (p99 within 2 s)",
    12: "every job and run lives on one home alone, the one the final shard map gives its partition",
}
CONCURRENCY_SKIP = "skipped: the previous run is still active"
TERMINAL = frozenset({"succeeded", "failed", "skipped", "cancelled"})
FENCE_SLACK = timedelta(seconds=0.1)  # observation jitter of the lease poller


def check_all(ev: Evidence) -> list[Violation]:
    violations: list[Violation] = []
    for check in (check_slots, check_ended, check_deliveries, check_fencing, check_takeovers, check_start_lag,
                  check_exits, check_failovers, check_placement):
        violations += check(ev)
    return violations


def _at(moment: datetime | None) -> str:
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z") if moment else "-"


def check_slots(ev: Evidence) -> list[Violation]:
    """1: each slot up to the check horizon has one record, no record is for a slot the schedule does
    not imply, and a slot is skipped only by a concurrency ``skip`` job whose previous run was active."""
    found: list[Violation] = []
    by_job: dict[uuid.UUID, list[dict[str, Any]]] = defaultdict(list)
    for run in ev.runs:
        by_job[run["job_id"]].append(run)
    slots_checked = 0
    for job in ev.jobs.values():
        expected = set(job.slots(ev.check_end))
        slots_checked += len(expected)
        records = [r for r in by_job[job.job_id] if r["scheduled_at"] <= ev.check_end]
        per_slot = Counter(r["scheduled_at"] for r in records)
        for slot in sorted(expected):
            if per_slot[slot] == 0:
                found.append(Violation(1, f"{job.name}: slot {_at(slot)} has no run record"))
            elif per_slot[slot] > 1:
                found.append(Violation(1, f"{job.name}: slot {_at(slot)} has {per_slot[slot]} run records"))
        for run in records:
            slot = run["scheduled_at"]
            if slot not in expected:
                found.append(Violation(1, f"{job.name}: run {run['run_id']} for {_at(slot)}, not a slot of the job"))
            elif run["trigger"] == "catchup":
                found.append(Violation(1, f"{job.name}: slot {_at(slot)} fired more than 60 s late (catch-up: "
                                          f"{run['reason']})"))
            elif run["status"] == "skipped" and not (job.concurrency == "skip"
                                                     and (run["reason"] or "").startswith(CONCURRENCY_SKIP)):
                found.append(Violation(1, f"{job.name}: slot {_at(slot)} skipped: {run['reason']}"))
    ev.figures["slots_checked"] = slots_checked
    ev.figures["skipped_by_concurrency"] = sum(1 for r in ev.runs if r["status"] == "skipped")
    return found


def check_ended(ev: Evidence) -> list[Violation]:
    """2: after the drain, a run that has not ended must hold a live lease, have just been queued, be
    about to be retried, or wait behind an active run; ended runs have a finish time."""
    found = []
    in_flight = 0
    for row in ev.unfinished:
        proven = row["lease_live"] if row["status"] == "running" else (
            row["queued"] or row["retry_pending"] or row["held"])
        if proven:
            in_flight += 1
        else:
            found.append(Violation(2, f"run {row['run_id']} is stuck {row['status']} (attempt {row['attempt']}): "
                                      "no live lease, no fresh queue entry, no retry trigger about to fire"))
    for run in ev.runs:
        if run["status"] in TERMINAL and run["finished_at"] is None:
            found.append(Violation(2, f"run {run['run_id']} is {run['status']} without a finish time"))
    ev.figures["runs_in_flight_at_end"] = in_flight
    return found


def check_deliveries(ev: Evidence) -> list[Violation]:
    """3: the target saw the successful attempt of every succeeded run answered 2xx; every delivery
    names a run that exists and was not skipped, with the run id as its Idempotency-Key."""
    found = []
    runs = {r["run_id"]: r for r in ev.runs}
    by_run: dict[str, list[Delivery]] = defaultdict(list)
    for delivery in ev.deliveries:
        by_run[delivery.run_id or ""].append(delivery)
    for run_key, deliveries in by_run.items():
        run_id = _uuid(run_key)
        run = runs.get(run_id) if run_id else None
        if run is None:
            found.append(Violation(3, f"{len(deliveries)} deliveries of run {run_key!r}, which has no record"))
            continue
        keys = {d.idempotency_key for d in deliveries}
        if keys != {run_key}:
            found.append(Violation(3, f"run {run_key}: deliveries carried Idempotency-Keys {sorted(map(str, keys))}"))
        if run["status"] == "skipped":
            found.append(Violation(3, f"run {run_key} was skipped but delivered {len(deliveries)} times"))
    for run in ev.runs:
        if run["status"] != "succeeded":
            continue
        delivered = [d for d in by_run.get(str(run["run_id"]), []) if d.attempt == run["attempt"] and d.succeeded]
        if not delivered:
            found.append(Violation(3, f"run {run['run_id']} succeeded (attempt {run['attempt']}) but the target "
                                      "never answered that attempt with a success"))
    ev.figures["deliveries"] = len(ev.deliveries)
    # At-least-once at work: delivered again after the target had answered 2xx (the outcome was lost).
    ev.figures["runs_redelivered_after_success"] = sum(
        1 for d in by_run.values() if any(x.succeeded for x in d[:-1]))
    return found


def check_fencing(ev: Evidence) -> list[Violation]:
    """4: outcomes, attempt histories and fires agree with who held the lease when they were written."""
    found = _outcomes_match_deliveries(ev)
    for run in ev.runs:
        found += _history(run, ev.attempts.get(run["run_id"], []))
    found += _one_claim_per_attempt(ev.deliveries)
    found += _fires_within_leases(ev)
    return found


def _outcomes_match_deliveries(ev: Evidence) -> list[Violation]:
    """An attempt recorded from an answer must be the answer to *that* attempt of *that* run: a stale
    worker's outcome written over a newer attempt would name an older delivery."""
    found = []
    deliveries = {d.number: d for d in ev.deliveries}
    for run_id, attempts in ev.attempts.items():
        for attempt in attempts:
            number = delivery_number(attempt["output"])
            if number is None:
                continue
            delivery = deliveries.get(number)
            if delivery is None or delivery.run_id != str(run_id) or delivery.attempt != attempt["attempt"]:
                seen = f"run {delivery.run_id} attempt {delivery.attempt}" if delivery else "nothing"
                found.append(Violation(4, f"run {run_id} attempt {attempt['attempt']} ({attempt['status']}, "
                                          f"{attempt['worker_id']}) was recorded from delivery {number}, "
                                          f"which was {seen}"))
            elif delivery.succeeded != (attempt["status"] == "succeeded"):
                found.append(Violation(4, f"run {run_id} attempt {attempt['attempt']} recorded {attempt['status']} "
                                          f"but the target answered {delivery.answer}"))
    return found


def _history(run: dict[str, Any], attempts: list[dict[str, Any]]) -> list[Violation]:
    """Attempts numbered 1..n without gaps, matching the run's attempt and final status, in time order,
    none succeeded but the last, and a succeeded run's worker is the one that recorded it."""
    rid, status = run["run_id"], run["status"]
    numbers = [a["attempt"] for a in attempts]
    problems = []
    if numbers != list(range(1, len(numbers) + 1)):
        problems.append(f"attempts numbered {numbers}")
    if status in ("succeeded", "failed"):
        if not attempts or numbers[-1] != run["attempt"] or attempts[-1]["status"] != status:
            last = f"{numbers[-1]} {attempts[-1]['status']}" if attempts else "none"
            problems.append(f"{status} at attempt {run['attempt']}, last attempt recorded: {last}")
        elif status == "succeeded" and attempts[-1]["worker_id"] != run["worker_id"]:
            problems.append(f"claimed by {run['worker_id']} but its success recorded by {attempts[-1]['worker_id']}")
    elif status in ("scheduled", "running") and len(attempts) != run["attempt"] - 1:
        problems.append(f"{status} at attempt {run['attempt']} with {len(attempts)} attempts recorded")
    elif status == "skipped" and attempts:
        problems.append(f"skipped, yet {len(attempts)} attempts recorded")
    if any(a["status"] == "succeeded" for a in attempts[:-1]):
        problems.append("an attempt succeeded and yet the run was attempted again")
    for earlier, later in itertools.pairwise(attempts):
        if later["started_at"] is not None and later["started_at"] < earlier["finished_at"]:
            problems.append(f"attempt {later['attempt']} started ({_at(later['started_at'])}) before attempt "
                            f"{earlier['attempt']} finished ({_at(earlier['finished_at'])})")
    for attempt in attempts:
        if attempt["started_at"] is not None and attempt["finished_at"] < attempt["started_at"]:
            problems.append(f"attempt {attempt['attempt']} finished before it started")
    return [Violation(4, f"run {rid}: {problem}") for problem in problems]


def _one_claim_per_attempt(deliveries: list[Delivery]) -> list[Violation]:
    """Every claim draws a new lease token, and the token travels with the call: one attempt number
    delivered under two tokens was claimed twice."""
    tokens: dict[tuple[str | None, int | None], set[str | None]] = defaultdict(set)
    for delivery in deliveries:
        tokens[(delivery.run_id, delivery.attempt)].add(delivery.lease_token)
    return [Violation(4, f"run {run} attempt {attempt} was delivered under {len(seen)} lease tokens")
            for (run, attempt), seen in tokens.items() if len(seen) > 1]


def _fires_within_leases(ev: Evidence) -> list[Violation]:
    """A fire prepared (``fired_at``) while a lease token was still seen valid, but written
    (``created_at``) after the harness saw that token replaced, came from a node that had lost the
    partition: the fence should have refused it."""
    found = []
    ended: dict[tuple[int, int], list[tuple[datetime, datetime | None, Any]]] = {}
    for run in ev.runs:
        fired, created = run["fired_at"], run["created_at"]
        if fired is None:
            continue
        # The lease rows of the home that held the partition when the run was written (moves change it).
        home, history = ev.lease_history(run["partition_id"], created)
        spans = ended.get((home, run["partition_id"]))
        if spans is None:
            spans = ended[(home, run["partition_id"])] = sorted(
                ((s.ended_seen, s.last_valid, s) for s in history if s.ended_seen is not None), key=lambda e: e[0])
        if not spans:
            continue
        index = _last_before(spans, created - FENCE_SLACK)
        if index < 0:
            continue
        _, last_valid, span = spans[index]
        if last_valid is not None and last_valid > fired + FENCE_SLACK:
            found.append(Violation(4, f"run {run['run_id']} (partition {run['partition_id']}) fired at {_at(fired)} "
                                      f"and written at {_at(created)}, after token {span.token} of {span.owner} "
                                      f"(valid at {_at(last_valid)}) was replaced at {_at(span.ended_seen)}"))
    return found


def _last_before(spans: list[tuple[datetime, datetime | None, Any]], moment: datetime) -> int:
    low, high = 0, len(spans)
    while low < high:
        middle = (low + high) // 2
        if spans[middle][0] < moment:
            low = middle + 1
        else:
            high = middle
    return low - 1


def _uuid(text: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(text)
    except ValueError:
        return None


def check_exits(ev: Evidence) -> list[Violation]:
    """7: a role survives every fault aimed elsewhere, a database restart while it starts included (it
    waits for the database): one that exits on its own crashed (the harness started it again)."""
    found = []
    for gone in ev.exits:
        last = gone.log_tail.strip().splitlines()[-1:] or [""]
        found.append(Violation(7, f"{gone.member} exited with code {gone.code} after "
                                  f"{gone.at - gone.started:.0f} s: {last[0][:300]}"))
    return found


def check_placement(ev: Evidence) -> list[Violation]:
    """12: with shards, each job and run found on exactly one home, the one the final map gives its
    partition: a move that left its copies on the source, lost them on the target, or cut over
    without them would show here (the other checks read each row on its home by the map)."""
    if ev.placement is None:
        return []
    found = []
    for row_id, (what, partition, homes) in ev.placement.items():
        home = ev.home(partition)
        if homes != {home}:
            found.append(Violation(12, f"{what} {row_id} (partition {partition}) is on {_homes(homes)}; the map "
                                       f"gives partition {partition} to {_homes({home})}"))
    ev.figures["rows_placed"] = len(ev.placement)
    return found


def _homes(homes: set[int]) -> str:
    return " and ".join("catalog" if h == 0 else f"shard-{h}" for h in sorted(homes))
