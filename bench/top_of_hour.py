"""The scheduler path at the top of the hour: N recurring jobs that share one cron expression come due
in the same second, on top of M idle schedules that only make the trigger index big.

One real ``chimes scheduler`` process (no worker: the runs wait in the queue) fires them; the figure
is fires per second from the due second to the last run created, read from ``runs.fired_at``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import asyncpg

from bench import seed
from bench.chimes_runs import Fleet, FleetShape, _wait_for
from bench.env import (
    STATS_FLUSH_SEC,
    Env,
    counters_since,
    describe_counters,
    drop_database,
    fresh_database,
    server_counters,
    statement_costs,
)
from bench.procs import CpuMeter
from bench.report import Result, percentiles
from chimes.store import db

# The runs of the rounds before, finished as a worker would have finished them: with no worker they
# would pile up (50,000 more each round), and the node's health check and reaper, which read every
# unstarted and unfinished run, would be measured reading a backlog that a fleet with workers has not.
FINISH_EARLIER_RUNS = """
WITH done AS (
    UPDATE runs SET status = 'succeeded', attempt = 1, started_at = fired_at, finished_at = fired_at
    WHERE owner = 'bench' AND status = 'scheduled' AND started_at IS NULL
    RETURNING run_id
),
dequeued AS (DELETE FROM run_queue q USING done d WHERE q.run_id = d.run_id)
DELETE FROM active_runs a USING done d WHERE a.run_id = d.run_id
"""
# Whether the burst's triggers are all fired (a fire deletes its trigger in the transaction that
# makes the run): a few index lookups, where counting the round's runs read more the more rounds
# had run, and was measured as PostgreSQL's time.
UNFIRED = """
SELECT EXISTS (SELECT 1 FROM triggers WHERE partition_id = ANY($2::smallint[]) AND fire_at = $1)
"""
EVERY_PARTITION = list(range(1024))

FIRED = """
SELECT extract(epoch FROM fired_at - scheduled_at) AS fire_lag, extract(epoch FROM fired_at) AS fired
FROM runs WHERE owner = 'bench' AND scheduled_at = $1
"""


async def top_of_hour(env: Env, *, runs: int, idle: int, shape: FleetShape, say: Callable[[str], None],
                      rounds: int = 1) -> list[Result]:
    """``rounds`` bursts, one after the other, on the same index (seeding it is the slow part): the
    jobs of a round, once fired, wait for tomorrow and count as idle for the next round."""
    dsn = await fresh_database(env, env.database("top_of_hour"), chimes_schema=True)
    pool = await db.create_pool(dsn, max_size=2)
    results = []
    try:
        seeded = await seed.add_idle_schedules(pool, idle, say) if idle else 0.0
        fleet = Fleet(env, dsn, FleetShape(schedulers=shape.schedulers, workers=0), "top-of-hour")
        try:
            await fleet.wait_ready()
            for number in range(rounds):
                result = await _round(env, dsn, pool, fleet, runs, idle + number * runs, say)
                result.system = f"chimes scheduler, round {number + 1}" if rounds > 1 else result.system
                result.extra["idle_seed_sec"] = round(seeded, 1)
                results.append(result)
        finally:
            fleet.stop()
        for result in results:
            result.peak_mb = fleet.peaks()
    finally:
        await pool.close()
        await drop_database(env, env.database("top_of_hour"))
    return results


# The CPU, the counters and the statements are measured from this long before the due second: just
# before the node's scan reads the burst (its look-ahead is 5 s), whatever the size of the index.
# Measured from the end of the seeding instead, the window grew with the index (2 s more at a
# million idle schedules, 20 s at ten million), and with it the share of the node's periodic loops
# (the health check every 10 s, the reaper) counted against the fires.
MEASURED_BEFORE_DUE_SEC = 6.5


async def _round(env: Env, dsn: str, pool: asyncpg.Pool, fleet: Fleet, runs: int, idle: int,
                 say: Callable[[str], None]) -> Result:
    async with pool.acquire() as conn:
        await conn.execute(FINISH_EARLIER_RUNS)
        await conn.execute("VACUUM ANALYZE runs, run_queue, active_runs")
    # What the seeding and the rounds before wrote is still in the kernel's page cache, and its
    # writeback (768 MB after seeding a million idle schedules) fell into the round at a moment that
    # varied from one command to the next, slowing PostgreSQL's commits by a varying amount. A
    # fleet's schedules were written long before its burst: flushed first.
    dirty_mb = await asyncio.to_thread(_flush_page_cache)
    # Creating the jobs and analyzing the tables takes longer the bigger the index.
    due = seed.due_instant(MEASURED_BEFORE_DUE_SEC + 3.0 + STATS_FLUSH_SEC + runs / 10_000 + idle / 500_000)
    # Every job: a 6-field cron whose next fire is the due second, daily; all share it.
    spec = seed.http_job("hourly", seed.daily_at(due), "http://127.0.0.1:9/hook")
    took = await seed.add_jobs(pool, spec, runs)
    async with pool.acquire() as conn:
        await conn.execute("ANALYZE jobs")
        await conn.execute("ANALYZE triggers")
    start = due - timedelta(seconds=MEASURED_BEFORE_DUE_SEC + STATS_FLUSH_SEC)  # server_counters waits that
    if datetime.now(UTC) > start:
        raise RuntimeError("creating the jobs took longer than the lead time")
    await asyncio.sleep((start - datetime.now(UTC)).total_seconds())
    before = await server_counters(pool)
    if env.statements:
        await pool.execute("SELECT pg_stat_statements_reset()")
    say(f"top-of-hour: {runs:,} recurring jobs in {took:.1f}s on {idle:,} idle schedules, due at {due:%H:%M:%S}")
    meter = CpuMeter(fleet.procs, env.postmasters)
    meter.start()

    async def all_fired() -> bool:
        return not await pool.fetchval(UNFIRED, due, EVERY_PARTITION)

    await asyncio.sleep(max(0.0, (due - datetime.now(UTC)).total_seconds()))  # nothing fires before
    await _wait_for(all_fired, 120 + runs / 500, "every trigger to fire", fleet)
    cpu = meter.stop()
    after = await server_counters(pool)
    spent = counters_since(before, after, runs)
    rows = await pool.fetch(FIRED, due)
    index = await pool.fetchval("SELECT count(*) FROM triggers")
    costs = await statement_costs(env, dsn)
    fired = [float(r["fired"]) for r in rows]
    lags = [float(r["fire_lag"]) for r in rows]
    result = Result("chimes scheduler", "top-of-hour", runs, len(rows), max(fired) - due.timestamp(),
                    fire_lag=percentiles(lags), cpu_sec=cpu, start_lags=lags)
    spread = max(fired) - min(fired)
    result.extra = {"idle_schedules": idle, "triggers_in_index": index, "flushed_before_mb": dirty_mb,
                    "fires_per_sec_while_firing": round(len(rows) / spread, 1) if spread > 0 else None,
                    "cpu_ms_per_fire": {name: round(sec / runs * 1000, 3) for name, sec in cpu.items()},
                    **spent}
    if costs:
        result.extra["statements"] = costs
    per_fire = ", ".join(f"{name} {ms:.3f}" for name, ms in result.extra["cpu_ms_per_fire"].items())
    result.notes = (f"{idle:,} idle schedules; runs/s = fires/s from the due second; lags are fire lags; "
                    f"{result.extra['fires_per_sec_while_firing']} fires/s from first to last fire; "
                    f"CPU ms per fire: {per_fire}; {describe_counters(spent)}; "
                    f"{dirty_mb} MB of the kernel's dirty pages flushed before the round")
    return result


def _flush_page_cache() -> int:
    """Write the kernel's dirty pages to disk (``sync``); returns how many MB were dirty before."""
    dirty_kb = 0
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("Dirty:"):
                dirty_kb = int(line.split()[1])
    os.sync()
    return dirty_kb // 1024
