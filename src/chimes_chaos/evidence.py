"""What the invariant checker reads: the database after the run, plus what the harness saw during it.

With shards, a job's runs, attempts, queue entries and leases live on the job's home: every read
below is made on every home, each home's rows kept only for the partitions the final shard map gives
it, and the answers merged. Where each job and run was found is kept apart (``placement``): one found
on another home, or on two, is a violation of its own (12), not a row counted twice.
"""

from __future__ import annotations

import bisect
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg

from chimes.ids import partition_of
from chimes_chaos.faults import FaultWindow
from chimes_chaos.fleet import Exit, FleetShape
from chimes_chaos.moves import MoveWindow
from chimes_chaos.observer import LeaseObserver, Span
from chimes_chaos.target import Delivery
from chimes_chaos.workload import Answer, ChaosJob

RUNS_SQL = """
SELECT run_id, scheduled_at, job_id, partition_id, trigger, status, attempt, fired_at, created_at, started_at,
       finished_at, worker_id, reason
FROM runs WHERE job_id = ANY($1::uuid[])
"""
ATTEMPTS_SQL = """
SELECT a.run_id, r.job_id, a.attempt, a.worker_id, a.status, a.started_at, a.finished_at, a.error, a.output
FROM run_attempt_history a JOIN runs r ON r.run_id = a.run_id AND r.scheduled_at = a.scheduled_at
WHERE r.job_id = ANY($1::uuid[])
ORDER BY a.run_id, a.attempt
"""
# Runs not ended, with what would prove them still in flight: a live lease before its deadline, a
# place in the queue taken only just now, a retry trigger about to fire, or a place among a job's
# held runs. A run waiting longer than that after the drain is stuck, not in flight.
UNFINISHED_SQL = """
SELECT r.run_id, r.job_id, r.status, r.attempt,
       EXISTS (SELECT 1 FROM leases_in_force l WHERE l.run_id = r.run_id AND l.token = r.lease_token
               AND l.expires_at > now() AND l.deadline_at > now()) AS lease_live,
       EXISTS (SELECT 1 FROM run_queue q WHERE q.run_id = r.run_id
               AND q.enqueued_at > now() - interval '10 seconds') AS queued,
       EXISTS (SELECT 1 FROM triggers t WHERE t.trigger_id = r.run_id AND t.kind = 1
               AND t.fire_at > now() - interval '5 seconds') AS retry_pending,
       EXISTS (SELECT 1 FROM active_runs a WHERE a.run_id = r.run_id AND a.held) AS held
FROM runs r WHERE r.job_id = ANY($1::uuid[]) AND r.status IN ('scheduled', 'running')
"""


@dataclass(frozen=True, slots=True)
class Violation:
    invariant: int
    what: str


@dataclass
class Evidence:
    jobs: dict[uuid.UUID, ChaosJob]
    runs: list[dict[str, Any]]
    attempts: dict[uuid.UUID, list[dict[str, Any]]]
    unfinished: list[dict[str, Any]]
    deliveries: list[Delivery]
    faults: list[FaultWindow]
    exits: list[Exit]
    leases: LeaseObserver
    shape: FleetShape
    started: datetime  # the fault phase began
    faults_ended: datetime
    check_end: datetime  # every slot up to here must have its run record
    figures: dict[str, Any] = field(default_factory=dict)
    answers: list[Answer] = field(default_factory=list)  # every write the harness sent the API
    jobs_found: set[uuid.UUID] | None = None  # of ``jobs``, those in the database at the end (None: not read)
    probe: tuple[int, int | None] | None = None  # the write probe: (last N acknowledged, N found at the end)
    home_of: list[int] | None = None  # with shards: each partition's home by the final map (0 the catalog)
    # With moves: each partition's home before the first move, the moves, each home's lease observer,
    # and where each job and run was found: id -> ("job" or "run", partition, the homes holding it).
    first_home_of: list[int] | None = None
    moves: list[MoveWindow] = field(default_factory=list)
    lease_homes: list[LeaseObserver] | None = None
    placement: dict[uuid.UUID, tuple[str, int, set[int]]] | None = None

    def home(self, partition: int) -> int:
        return self.home_of[partition] if self.home_of is not None else 0

    def home_at(self, partition: int, moment: datetime) -> int:
        """The home that held ``partition`` at ``moment``: its first, then each cut-over's target."""
        if self.first_home_of is None:
            return self.home(partition)
        home = self.first_home_of[partition]
        at = moment.timestamp()
        for move in self.moves:  # in the order they ran
            if move.cut_over_at is not None and move.cut_over_at <= at and move.covers(partition):
                home = move.target
        return home

    def lease_history(self, partition: int, moment: datetime) -> tuple[int, list[Span]]:
        """The lease spans of ``partition`` on the home that held it at ``moment``, and that home."""
        if self.lease_homes is None:
            return 0, self.leases.spans.get(partition, [])
        home = self.home_at(partition, moment)
        return home, self.lease_homes[home].spans.get(partition, [])

    def held_at(self, owner: str, moment: datetime) -> dict[int, Span]:
        """The spans ``owner`` held at ``moment``, each partition's on the home that held it then."""
        if self.lease_homes is None:
            return self.leases.held_at(owner, moment)
        held: dict[int, Span] = {}
        for home, observer in enumerate(self.lease_homes):
            held |= {p: span for p, span in observer.held_at(owner, moment).items() if self.home_at(p, moment) == home}
        return held

    def next_span(self, span: Span) -> Span | None:
        if self.lease_homes is None:
            return self.leases.next_span(span)
        history = self.lease_homes[span.home].spans.get(span.partition, [])
        index = bisect.bisect_right(history, span.first_seen, key=lambda other: other.first_seen)
        return history[index] if index < len(history) else None

    def moving(self, partition: int, start: datetime, end: datetime, settle: float) -> bool:
        """Whether a move of ``partition`` was under way at any time from ``start`` to ``end`` (its
        window widened by ``settle`` seconds: the target's nodes take the range within a lease round)."""
        first, last = start.timestamp(), end.timestamp()
        return any(m.covers(partition) and m.started <= last and (m.ended or last) + settle >= first
                   for m in self.moves)


Placement = dict[uuid.UUID, tuple[str, int, set[int]]]


def _kept(home_of: list[int] | None, home: int, partition: int) -> bool:
    return home_of is None or home_of[partition] == home


async def jobs_found(homes: list[asyncpg.Connection], job_ids: list[uuid.UUID], home_of: list[int] | None = None,
                     placement: Placement | None = None) -> dict[uuid.UUID, str]:
    """Of ``job_ids``, those in the databases, with their names: each read on its home by ``home_of``
    (the final map; None: on every home). Every home each was found on goes into ``placement``."""
    found: dict[uuid.UUID, str] = {}
    for home, conn in enumerate(homes):
        rows = await conn.fetch("SELECT job_id, name FROM jobs WHERE job_id = ANY($1::uuid[])", job_ids)
        for row in rows:
            partition = partition_of(row["job_id"])
            if placement is not None:
                placement.setdefault(row["job_id"], ("job", partition, set()))[2].add(home)
            if _kept(home_of, home, partition):
                found[row["job_id"]] = row["name"]
    return found


async def unfinished_count(homes: list[asyncpg.Connection], job_ids: list[uuid.UUID]) -> int:
    count = 0
    for conn in homes:
        count += await conn.fetchval("SELECT count(*) FROM runs WHERE job_id = ANY($1::uuid[]) "
                                     "AND status IN ('scheduled', 'running')", job_ids)
    return count


async def read_database(homes: list[asyncpg.Connection], job_ids: list[uuid.UUID], home_of: list[int] | None = None,
                        placement: Placement | None = None) -> tuple[
        list[dict[str, Any]], dict[uuid.UUID, list[dict[str, Any]]], list[dict[str, Any]]]:
    """The runs, attempts (by run) and unfinished runs of ``job_ids``, each read on its home by
    ``home_of`` (the final map; None: on every home), merged. Every home each run was found on goes
    into ``placement``."""
    runs: list[dict[str, Any]] = []
    attempts: dict[uuid.UUID, list[dict[str, Any]]] = defaultdict(list)
    unfinished: list[dict[str, Any]] = []
    for home, conn in enumerate(homes):
        found = [dict(r) for r in await conn.fetch(RUNS_SQL, job_ids)]
        if placement is not None:
            for run in found:
                placement.setdefault(run["run_id"], ("run", run["partition_id"], set()))[2].add(home)
        runs += [r for r in found if _kept(home_of, home, r["partition_id"])]
        for row in await conn.fetch(ATTEMPTS_SQL, job_ids):
            if _kept(home_of, home, partition_of(row["job_id"])):
                attempts[row["run_id"]].append(dict(row))
        unfinished += [dict(r) for r in await conn.fetch(UNFINISHED_SQL, job_ids)
                       if _kept(home_of, home, partition_of(r["job_id"]))]
    return runs, dict(attempts), unfinished
