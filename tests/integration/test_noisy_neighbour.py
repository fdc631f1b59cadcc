"""One team's burst against a slow target leaves another team's runs on time.

Team-a's 2,000 one-off runs fall due at once and their target holds every call; team-b's 20 fall due
three seconds later. The worker runs at most its owner share of team-a's (chimes.worker.tiers) and
starts team-b's within a second of their time, both on a fresh database and on one whose queue
statistics were analysed while the fleet was busy (after it had drained a burst): with those, a
claim written as ``DELETE ... WHERE key IN (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED)`` took the
whole queue, and team-b's runs waited for team-a's batch to end (tests/integration/test_claim_limits.py).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from chimes.jobs import JobSpec
from chimes.services.jobs import first_fire
from chimes.settings import WORKER_CONCURRENCY
from chimes.store.bulk import copy_rows, job_rows
from chimes.worker.tiers import TierPolicy
from tests.helpers import Homes, wait_for
from tests.integration.fleet import FAST_WORKER, running_fleet
from tests.target import Target

pytestmark = pytest.mark.single_database("writes jobs and sets the queue's statistics on one database")

BURST = 2000
OTHERS = 20
LATER_SEC = 3.0
ON_TIME_SEC = 1.0
WORKER = replace(FAST_WORKER, concurrency=WORKER_CONCURRENCY)
OWNER_CAP = TierPolicy().owner_cap(WORKER_CONCURRENCY)


async def add_one_offs(pool: asyncpg.Pool, owner: str, count: int, at: datetime, url: str) -> None:
    """``count`` one-off jobs of ``owner`` due at ``at``, written as the importer writes them."""
    spec = JobSpec.model_validate({"name": f"{owner}-burst", "schedule": {"at": at.isoformat()},
                                   "task": {"type": "http", "method": "POST", "url": url}})
    async with pool.acquire() as conn, conn.transaction():
        await copy_rows(conn, job_rows([spec] * count, owner, datetime.now(UTC), first_fire))


def next_second(after_sec: float) -> datetime:
    return (datetime.now(UTC) + timedelta(seconds=after_sec)).replace(microsecond=0) + timedelta(seconds=1)


async def queue_empty(pool: asyncpg.Pool) -> bool:
    return bool(await pool.fetchval("SELECT NOT EXISTS (SELECT 1 FROM run_queue)"))


@pytest.mark.parametrize("statistics", ["fresh", "analysed while busy"])
async def test_a_burst_of_one_team_leaves_another_teams_runs_on_time(
    pool: asyncpg.Pool, database_url: str, homes: Homes, target: Target, statistics: str
) -> None:
    # No autovacuum on the queue during the test: the statistics are the ones set here.
    await pool.execute("ALTER TABLE run_queue SET (autovacuum_enabled = false)")
    target.delays["/a"] = lambda _: 60.0  # holds team-a's calls past the end of the test
    async with running_fleet(pool, database_url, homes, worker=WORKER) as fleet:
        await wait_for(fleet.listening, timeout=10, what="the worker to listen")
        if statistics == "analysed while busy":
            await add_one_offs(pool, "team-c", 300, next_second(1.0), f"{target.url}/c")
            await wait_for(lambda: len(target.calls_to("/c")) == 300, timeout=30, what="team-c's burst")
            await wait_for(lambda: queue_empty(pool), timeout=10, what="the queue to drain")
            await pool.execute("ANALYZE run_queue")
            pages, rows = await pool.fetchrow("SELECT relpages, reltuples FROM pg_class WHERE relname = 'run_queue'")
            assert pages > 0 and rows == 0, "the statistics of a drained queue"
        due = next_second(2.0)
        await add_one_offs(pool, "team-a", BURST, due, f"{target.url}/a")
        await add_one_offs(pool, "team-b", OTHERS, due + timedelta(seconds=LATER_SEC), f"{target.url}/b")
        await wait_for(lambda: len(target.calls_to("/b")) == OTHERS, timeout=LATER_SEC + 20,
                       what="team-b's runs to start")
        running_a = await pool.fetchval("SELECT count(*) FROM runs WHERE owner = 'team-a' AND status = 'running'")
    late = sorted(call.received_at - datetime.fromisoformat(call.headers["X-Chimes-Scheduled-At"]).timestamp()
                  for call in target.calls_to("/b"))
    assert late[-1] < ON_TIME_SEC, f"team-b's runs started up to {late[-1]:.2f} s late ({statistics})"
    assert target.most_in_flight["/a"] <= OWNER_CAP, f"{target.most_in_flight['/a']} of team-a's calls at once"
    assert running_a <= OWNER_CAP, f"{running_a} of team-a's runs taken by the worker"
