"""What a worker's claim costs the database while one owner holds its share of the worker.

``python -m bench skip-claim --runs N``: N one-off runs of one owner, fired into the queue by a real
scheduler node (no worker runs them), then claims timed one after the other on that queue,
alternating: a claim of 100 that skips nobody (it takes the head of the queue), and a claim that
skips the owner, as a worker sends once the owner holds its share of it (``--owner-share``). That one
reads past every queued run of the owner and finds nothing; its cost follows the depth of the
backlog, which is why the worker's poll backs off while it finds nothing (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg

from bench import seed
from bench.chimes_runs import Fleet, FleetShape, _wait_for
from bench.env import Env, drop_database, fresh_database
from bench.report import Result
from chimes.store import db
from chimes.store.working import WorkerStore

OWNER = "bench"  # seed.add_jobs' owner
CLAIMS = 5  # of each kind, alternating
LEASE_SEC, GRACE_SEC = 300.0, 30.0


@contextlib.asynccontextmanager
async def queued_runs(env: Env, name: str, runs: int) -> AsyncIterator[asyncpg.Pool]:
    """A fresh database named ``name`` with ``runs`` one-off runs of one owner in its queue, fired by a
    real scheduler node that is stopped once they are all queued: nothing else touches the queue."""
    dsn = await fresh_database(env, name, chimes_schema=True)
    fleet = Fleet(env, dsn, FleetShape(schedulers=1, workers=0), name)
    pool = await db.create_pool(dsn, max_size=2)
    try:
        await fleet.wait_ready()
        due = seed.due_instant(3.0 + runs / 20_000)
        job = seed.http_job("queued", seed.at(due), "http://127.0.0.1:9/never", concurrency="allow")
        await seed.add_jobs(pool, job, runs)

        async def all_queued() -> bool:
            return bool(await pool.fetchval("SELECT count(*) FROM run_queue") >= runs)

        await _wait_for(all_queued, 120 + runs / 1_000, "the scheduler to queue every run", fleet)
        fleet.stop()
        await pool.execute("VACUUM ANALYZE run_queue")
        yield pool
    finally:
        await pool.close()
        fleet.stop()
        await drop_database(env, name)


async def skip_claim(env: Env, *, runs: int, say: Any) -> Result:
    async with queued_runs(env, env.database("skip"), runs) as pool:
        store = WorkerStore(pool, "bench-skip-claim")
        head_ms: list[float] = []
        skipping_ms: list[float] = []
        for _ in range(CLAIMS):
            for skip, into in (((), head_ms), ((OWNER,), skipping_ms)):
                started = time.perf_counter()
                got = await store.claim(100, LEASE_SEC, GRACE_SEC, skip_owners=skip)
                into.append(round((time.perf_counter() - started) * 1000, 1))
                if skip and got:
                    raise RuntimeError("a claim skipping the only owner took runs")
        say(f"skip-claim: {runs:,} queued runs of one owner; a claim of 100 skipping nobody "
            f"{statistics.median(head_ms):.1f} ms (median of {CLAIMS}), one skipping the owner "
            f"{statistics.median(skipping_ms):.1f} ms")
    return Result("chimes", "skip-claim", runs, 0, None,
                  extra={"head_claim_ms": head_ms, "skipping_claim_ms": skipping_ms})


def skip_table(results: list[Result]) -> str:
    lines = ["queued runs | claim of 100 skipping nobody, ms | claim skipping the owner, ms",
             "------------+---------------------------------+-----------------------------"]
    for r in results:
        head = ", ".join(f"{ms:.1f}" for ms in r.extra["head_claim_ms"])
        skipping = ", ".join(f"{ms:.1f}" for ms in r.extra["skipping_claim_ms"])
        lines.append(f"{r.runs:>11,} | {head} | {skipping}")
    return "\n".join(lines)
