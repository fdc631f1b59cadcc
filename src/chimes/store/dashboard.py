"""What the dashboard reads: pages of jobs and runs, and a snapshot of the fleet. Read-only.

Every read is bounded: lists are keyset pages on an index (migration 0004), the fleet tables are
small (nodes, workers, 1,024 leases), and the queue and recent runs are read with caps.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import asyncpg

from chimes.enums import Priority
from chimes.ids import PARTITION_COUNT
from chimes.store.db import Conn, one_row
from chimes.store.jobs import JobRecord, LastRun, columns_of, last_runs
from chimes.store.queries import sql

JOB_FILTERS = ("all", "failing", "paused", "stalled")
# Upper end of a name prefix range: every name starting with the prefix sorts below prefix + this.
_PREFIX_END = "\U0010ffff"
_FIRST_ID = uuid.UUID(int=0)
_LAST_ID = uuid.UUID(int=(1 << 128) - 1)
# Fire-lag histogram buckets (seconds); a lag at or above a bound falls in the bucket after it.
LAG_BOUNDS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
LAG_SAMPLE = 20_000  # newest scheduled runs read for the histogram
RUNNING_SHOWN = 200  # in-flight runs listed on the fleet page
QUEUE_COUNT_CAP = 100_000  # counting a huge backlog exactly would cost more than it tells
_FAR_FUTURE = datetime(9999, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class JobCursor:
    """Where the next page of jobs starts: after this (lower-cased name, job id)."""

    name: str
    job_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class JobPage:
    jobs: list[JobRecord]
    next: JobCursor | None  # None: this was the last page
    keys: list[JobCursor] = field(default_factory=list)  # each job's place in the order, for merging pages


def merge_job_pages(pages: list[JobPage], limit: int) -> JobPage:
    """One page of jobs from the first pages of several databases (shards), each after the same
    cursor: the first ``limit`` in the order of the index (lower-cased name as UTF-8 bytes, the
    "C" collation's order, then id), and a cursor when any database had more."""
    entries = sorted(((key.name.encode(), key.job_id, job, key) for page in pages
                      for job, key in zip(page.jobs, page.keys, strict=True)), key=lambda e: (e[0], e[1]))
    chosen = entries[:limit]
    more = len(entries) > limit or any(page.next is not None for page in pages)
    return JobPage([e[2] for e in chosen], chosen[-1][3] if more and chosen else None, [e[3] for e in chosen])


@dataclass(frozen=True, slots=True)
class RunCursor:
    """Where the next (older) page of runs starts: before this (scheduled time, run id)."""

    scheduled_at: datetime
    run_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class QueueTier:
    tier: str
    depth: int  # at most QUEUE_COUNT_CAP
    oldest_sec: float | None

    @property
    def capped(self) -> bool:
        return self.depth >= QUEUE_COUNT_CAP


@dataclass(frozen=True, slots=True)
class FireLag:
    runs: int
    p50: float | None
    p99: float | None
    max: float | None
    buckets: list[int]  # len(LAG_BOUNDS) + 1 counts


@dataclass(slots=True)
class Fleet:
    nodes: list[asyncpg.Record]
    unleased: int
    workers: list[asyncpg.Record]
    running: list[asyncpg.Record]
    queue: list[QueueTier]
    fire_lag: FireLag
    failures: list[asyncpg.Record]
    partitions: int = PARTITION_COUNT
    running_by_worker: dict[str, list[asyncpg.Record]] = field(default_factory=dict)
    api_servers: list[asyncpg.Record] = field(default_factory=list)


class DashboardStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def jobs(self, owner: str | None, prefix: str, show: str, after: JobCursor | None,
                   limit: int) -> JobPage:
        """A page of jobs in name order whose name starts with ``prefix`` (case-insensitive)."""
        query = {
            "all": "dashboard_jobs_of_all" if owner is None else "dashboard_jobs_of_owner",
            "failing": "dashboard_failing_jobs",
            "paused": "dashboard_paused_jobs",
            "stalled": "dashboard_stalled_jobs",
        }[show]
        async with self._pool.acquire() as conn:
            start = await conn.fetchval(sql("dashboard_name_key"), prefix)  # lower() as the index has it
            if after is None or after.name < start:
                after = JobCursor(start, _FIRST_ID)
            rows = await conn.fetch(sql(query), owner, after.name, after.job_id, start + _PREFIX_END, limit + 1)
            last = await last_runs(conn, [r["job_id"] for r in rows[:limit]])
        jobs = [_job(r, last.get(r["job_id"])) for r in rows[:limit]]
        more = len(rows) > limit
        keys = [JobCursor(r["name_key"], r["job_id"]) for r in rows[:limit]]
        return JobPage(jobs, keys[-1] if more else None, keys)

    async def job_alerts(self, job_id: uuid.UUID, limit: int) -> tuple[asyncpg.Record | None, list[asyncpg.Record]]:
        """Whether the dead man's switch holds the job stalled now, and its dead-lettered notifications."""
        async with self._pool.acquire() as conn:
            stall = await conn.fetchrow(sql("dashboard_job_stall"), job_id)
            dead = await conn.fetch(sql("dashboard_job_dead_notifications"), job_id, limit)
        return stall, dead

    async def job_runs(self, job_id: uuid.UUID, status: str | None, before: RunCursor | None,
                       limit: int) -> list[asyncpg.Record]:
        """A page of a job's runs, newest first, optionally of one status."""
        at, run_id = (before.scheduled_at, before.run_id) if before else (_FAR_FUTURE, _LAST_ID)
        return await self._pool.fetch(sql("dashboard_job_runs"), job_id, status, at, run_id, limit)

    async def fleet(self, owner: str | None, now: datetime, lag_window: timedelta,
                    failure_minutes: int, *, with_queue: bool = True) -> Fleet:
        """Nodes and their partitions, workers and their runs, the queue, recent lag and failures.

        ``owner`` limits what names jobs (runs in flight, failures) to that owner's; the rest is
        the fleet's. Without ``with_queue`` the queue is not read (an empty list).
        """
        async with self._pool.acquire() as conn:
            nodes = await conn.fetch(sql("dashboard_nodes"))
            unleased = await conn.fetchval(sql("dashboard_unleased_partitions"))
            workers = await conn.fetch(sql("dashboard_workers"))
            running = await conn.fetch(sql("dashboard_running_runs"), owner, RUNNING_SHOWN)
            queue = await queue_tiers(conn) if with_queue else []
            fire_lag = await _fire_lag(conn, now - lag_window, now)
            failures = await conn.fetch(sql("dashboard_failures_per_minute"), failure_minutes, owner)
            api_servers = await conn.fetch(sql("dashboard_api_servers"))
        fleet = Fleet(nodes, unleased, workers, running, queue, fire_lag, failures, api_servers=api_servers)
        for run in running:
            fleet.running_by_worker.setdefault(run["worker_id"], []).append(run)
        return fleet


@dataclass(frozen=True, slots=True)
class FleetGauges:
    """The fleet-wide gauges of ``/metrics`` (chimes.metrics), read at scrape time."""

    queue: list[QueueTier]
    nodes: int  # scheduler nodes heartbeating within 30 s
    workers: int  # workers heartbeating within 60 s
    unleased: int  # partitions no live node holds


def add_up(homes: list[FleetGauges]) -> FleetGauges:
    """The gauges of several databases (shards) as one: queue depths added (each still capped) and
    the longest wait; unleased partitions added (each home has its own lease rows); nodes and workers
    the most any home counts, since every scheduler and worker process serves every home."""
    queue = [QueueTier(tiers[0].tier, min(QUEUE_COUNT_CAP, sum(t.depth for t in tiers)),
                       max((t.oldest_sec for t in tiers if t.oldest_sec is not None), default=None))
             for tiers in zip(*(home.queue for home in homes), strict=True)]
    return FleetGauges(queue, max(h.nodes for h in homes), max(h.workers for h in homes),
                       sum(h.unleased for h in homes))


async def fleet_gauges(pool: asyncpg.Pool) -> FleetGauges:
    async with pool.acquire() as conn:
        queue = await queue_tiers(conn)
        row = one_row(await conn.fetchrow(sql("metrics_fleet")))
    return FleetGauges(queue, row["nodes"], row["workers"], row["unleased"])


async def queue_tiers(conn: Conn) -> list[QueueTier]:
    """Runs waiting per priority tier (counted up to a cap) and how long the oldest has waited."""
    tiers = []
    for tier in Priority:
        row = one_row(await conn.fetchrow(sql("metrics_queue_tier"), tier, QUEUE_COUNT_CAP))
        tiers.append(QueueTier(tier.label, row["depth"], row["oldest_sec"]))
    return tiers


async def _fire_lag(conn: Conn, start: datetime, end: datetime) -> FireLag:
    rows = await conn.fetch(sql("dashboard_fire_lag"), _run_id_floor(start), _run_id_floor(end), start, end,
                            LAG_SAMPLE, list(LAG_BOUNDS))
    buckets = [0] * (len(LAG_BOUNDS) + 1)
    total = next((r for r in rows if r["bucket"] is None), None)
    for row in rows:
        if row["bucket"] is not None:
            buckets[row["bucket"]] = row["runs"]
    if total is None:
        return FireLag(0, None, None, None, buckets)
    return FireLag(total["runs"], total["p50"], total["p99"], total["max_lag"], buckets)


def _run_id_floor(instant: datetime) -> uuid.UUID:
    """The smallest run id scheduled at ``instant`` or later (ids.py: the top 48 bits are millis)."""
    return uuid.UUID(int=int(instant.timestamp() * 1000) << 80)


def _job(row: asyncpg.Record, last_run: LastRun | None) -> JobRecord:
    return JobRecord(
        job_id=row["job_id"], owner=row["owner"], columns=columns_of(row), paused=row["paused"],
        version=row["version"], created_at=row["created_at"], updated_at=row["updated_at"],
        next_run_at=row["next_run_at"], last_run=last_run,
        slots_fired=row.get("slots_fired") or 0,
    )
