"""What the invariant checker reads: the database after the run, plus what the harness saw during it.

With shards, a job's runs, attempts, queue entries and leases live on the job's home: every read
below is made on every home and the answers merged (a job is in one home, so nothing is counted twice).
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg

from chimes_chaos.faults import FaultWindow
from chimes_chaos.fleet import Exit, FleetShape
from chimes_chaos.observer import LeaseObserver
from chimes_chaos.target import Delivery
from chimes_chaos.workload import Answer, ChaosJob

RUNS_SQL = """
SELECT run_id, scheduled_at, job_id, partition_id, trigger, status, attempt, fired_at, created_at, started_at,
       finished_at, worker_id, reason
FROM runs WHERE job_id = ANY($1::uuid[])
"""
ATTEMPTS_SQL = """
SELECT a.run_id, a.attempt, a.worker_id, a.status, a.started_at, a.finished_at, a.error, a.output
FROM run_attempt_history a JOIN runs r ON r.run_id = a.run_id AND r.scheduled_at = a.scheduled_at
WHERE r.job_id = ANY($1::uuid[])
ORDER BY a.run_id, a.attempt
"""
# Runs not ended, with what would prove them still in flight: a live lease before its deadline, a
# place in the queue taken only just now, a retry trigger about to fire, or a place among a job's
# held runs. A run waiting longer than that after the drain is stuck, not in flight.
UNFINISHED_SQL = """
SELECT r.run_id, r.status, r.attempt,
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
    home_of: list[int] | None = None  # with shards: each partition's home (0 the catalog, k shard-k)

    def home(self, partition: int) -> int:
        return self.home_of[partition] if self.home_of is not None else 0


async def jobs_found(homes: list[asyncpg.Connection], job_ids: list[uuid.UUID]) -> dict[uuid.UUID, str]:
    """Of ``job_ids``, those in the databases (every home), with their names."""
    found: dict[uuid.UUID, str] = {}
    for conn in homes:
        rows = await conn.fetch("SELECT job_id, name FROM jobs WHERE job_id = ANY($1::uuid[])", job_ids)
        found |= {row["job_id"]: row["name"] for row in rows}
    return found


async def unfinished_count(homes: list[asyncpg.Connection], job_ids: list[uuid.UUID]) -> int:
    count = 0
    for conn in homes:
        count += await conn.fetchval("SELECT count(*) FROM runs WHERE job_id = ANY($1::uuid[]) "
                                     "AND status IN ('scheduled', 'running')", job_ids)
    return count


async def read_database(homes: list[asyncpg.Connection], job_ids: list[uuid.UUID]) -> tuple[
        list[dict[str, Any]], dict[uuid.UUID, list[dict[str, Any]]], list[dict[str, Any]]]:
    """The runs, attempts (by run) and unfinished runs of ``job_ids``, from every home, merged."""
    runs: list[dict[str, Any]] = []
    attempts: dict[uuid.UUID, list[dict[str, Any]]] = defaultdict(list)
    unfinished: list[dict[str, Any]] = []
    for conn in homes:
        runs += [dict(r) for r in await conn.fetch(RUNS_SQL, job_ids)]
        for row in await conn.fetch(ATTEMPTS_SQL, job_ids):
            attempts[row["run_id"]].append(dict(row))
        unfinished += [dict(r) for r in await conn.fetch(UNFINISHED_SQL, job_ids)]
    return runs, dict(attempts), unfinished
