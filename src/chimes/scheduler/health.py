"""Schedule health: the dead man's switch, and runs that miss their start deadline.

Both end in the same notification outbox as a final failure. A *stalled schedule* is a recurring
job (concurrency skip or queue) that has started no run for longer than its interval plus a grace,
because one run has been holding it back; a *missed start* is a run that waited in the queue past its
job's start deadline, because no worker took it. Each is notified once per run.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

import asyncpg

from chimes import cron
from chimes.store.queries import sql

log = logging.getLogger(__name__)

GRACE = timedelta(seconds=60)
QUEUE_HEADS = 100  # queued runs looked at per tier: the oldest, which are the first to be late


def interval_of(schedule: cron.CronSchedule, around: datetime) -> timedelta | None:
    """The gap between two fires of the schedule after ``around``."""
    first = cron.next_fire(schedule, around)
    second = cron.next_fire(schedule, first) if first is not None else None
    return None if first is None or second is None else second - first


def stalled(since: datetime, schedule: cron.CronSchedule, now: datetime, grace: timedelta = GRACE) -> bool:
    interval = interval_of(schedule, since)
    return interval is not None and now - since > interval + grace


class HealthCheck:
    def __init__(self, pool: asyncpg.Pool, grace: timedelta = GRACE) -> None:
        self._pool = pool
        self.grace = grace

    async def sweep(self, now: datetime) -> int:
        """Queue notifications for what is unhealthy now; returns how many were queued."""
        async with self._pool.acquire() as conn:
            late = await conn.fetch(sql("late_queued_runs"), QUEUE_HEADS)
            blocking = await conn.fetch(sql("blocking_runs"), self.grace.total_seconds())
            stuck = [r for r in blocking
                     if stalled(r["since"], cron.CronSchedule(r["cron"], r["timezone"], r["dst_gap"], r["dst_fold"]),
                                now, self.grace)]
            queued = 0
            if late:
                queued += await conn.fetchval(
                    sql("notify_runs"), "start_missed", [r["run_id"] for r in late], [r["scheduled_at"] for r in late],
                    [f"waited {int((now - r['enqueued_at']).total_seconds())}s in the queue, past its start deadline "
                     f"of {r['start_deadline_sec']}s: are workers running?" for r in late])
            if stuck:
                queued += await conn.fetchval(
                    sql("notify_runs"), "schedule_stalled", [r["run_id"] for r in stuck],
                    [r["scheduled_at"] for r in stuck],
                    [f"no run has started since {r['since'].isoformat()}: this run is still holding the schedule"
                     for r in stuck])
        if queued:
            log.warning("schedule health: %d notifications queued", queued)
        return queued
