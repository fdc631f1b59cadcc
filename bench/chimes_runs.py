"""Chimes through the scenarios, as real ``chimes scheduler`` and ``chimes worker`` processes.

Every figure comes from what Chimes itself recorded (``runs.fired_at``, ``started_at``,
``finished_at``) and from the target's own clock for when each call arrived.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

import asyncpg

from bench import seed, wal
from bench.env import Env, drop_database, fresh_database, statement_costs
from bench.procs import CpuMeter, Proc, python
from bench.report import Result, percentiles
from bench.target import TargetProcess
from chimes.store import db

Say = Callable[[str], None]

# What the burst's runs take on disk, kept for the retention period: every partition of the two
# history tables, with their indexes.
HISTORY_BYTES = """
SELECT coalesce(sum(pg_total_relation_size(i.inhrelid)), 0)
FROM pg_inherits i WHERE i.inhparent IN ('runs'::regclass, 'run_attempts'::regclass)
"""

LAGS = """
SELECT extract(epoch FROM fired_at - scheduled_at) AS fire_lag,
       extract(epoch FROM started_at - scheduled_at) AS start_lag,
       extract(epoch FROM finished_at) AS finished
FROM runs WHERE owner = 'bench'
"""


@dataclass
class FleetShape:
    schedulers: int = 1
    workers: int = 1
    concurrency: int = 200  # runs each worker executes at once
    worker_prefix: tuple[str, ...] = ()  # a command each worker runs under (bench.instructions: valgrind)
    owner_share: float | None = 1.0  # CHIMES_OWNER_SHARE; None: Chimes' default
    noop: bool = False  # the workers end no-op tasks at once (bench/noop_worker.py)


class Fleet:
    """Real Chimes processes on one database; every process logs to a file in the work folder."""

    def __init__(self, env: Env, dsn: str, shape: FleetShape, tag: str) -> None:
        self.dsn = dsn
        self.shape = shape
        common = {"CHIMES_DATABASE_URL": dsn, "CHIMES_DATA_DIR": str(env.workdir / "chimes"),
                  "CHIMES_LOG_FORMAT": "json", "CHIMES_EGRESS_ALLOW_LOOPBACK": "true"}  # targets on 127.0.0.1
        if shape.owner_share is not None:  # one team's burst, as a fleet that serves one team runs it
            common["CHIMES_OWNER_SHARE"] = str(shape.owner_share)
        worker = ("-m", "bench.noop_worker") if shape.noop else ("-m", "chimes", "worker")
        self.procs: list[Proc] = []
        for i in range(shape.schedulers):
            self.procs.append(Proc(f"scheduler{i + 1}" if shape.schedulers > 1 else "scheduler",
                                   python("-m", "chimes", "scheduler"), env.workdir / f"{tag}-scheduler{i}.log",
                                   common))
        for i in range(shape.workers):
            self.procs.append(Proc(f"worker{i + 1}" if shape.workers > 1 else "worker",
                                   [*shape.worker_prefix,
                                    *python(*worker, "--concurrency", str(shape.concurrency))],
                                   env.workdir / f"{tag}-worker{i}.log", common))

    async def wait_ready(self, limit_sec: float = 60.0) -> None:
        """Every partition leased by a live node, and every worker registered."""
        deadline = time.monotonic() + limit_sec
        conn = await asyncpg.connect(self.dsn)
        try:
            while True:
                dead = [p for p in self.procs if not p.alive()]
                if dead:
                    raise RuntimeError(f"{dead[0].name} exited:\n{dead[0].log_tail()}")
                leased = await conn.fetchval(
                    "SELECT count(*) FROM partition_leases WHERE owner IS NOT NULL AND expires_at > now()")
                workers = await conn.fetchval("SELECT count(*) FROM workers")
                if (leased == 1024 or not self.shape.schedulers) and workers == self.shape.workers:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"fleet not ready after {limit_sec}s: {leased} partitions, {workers} workers")
                await asyncio.sleep(0.2)
        finally:
            await conn.close()

    def stop(self) -> None:
        for proc in self.procs:
            # A worker under valgrind writes its counts as it exits, slowly: it is given the time.
            proc.stop(timeout=180.0 if self.shape.worker_prefix else 20.0)

    def peaks(self) -> dict[str, float]:
        return {p.name: round(p.peak_rss_mb(), 1) for p in self.procs}

    def warnings(self, keep: int = 5) -> dict[str, object]:
        """How many warnings each process logged, and the first few: a benchmark must not hide them."""
        found: dict[str, object] = {}
        for proc in self.procs:
            lines = [line for line in proc.log_path.read_text(errors="replace").splitlines()
                     if '"level":"WARNING"' in line or '"level":"ERROR"' in line]
            if lines:
                found[proc.name] = {"count": len(lines), "first": lines[:keep]}
        return found


async def _wait_for(condition: Callable[[], Awaitable[bool]], limit_sec: float, what: str, fleet: Fleet) -> None:
    deadline = time.monotonic() + limit_sec
    while not await condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        dead = [p for p in fleet.procs if not p.alive()]
        if dead:
            raise RuntimeError(f"{dead[0].name} exited:\n{dead[0].log_tail()}")
        await asyncio.sleep(0.25)


async def _count(pool: asyncpg.Pool, where: str) -> int:
    return await pool.fetchval(f"SELECT count(*) FROM runs WHERE owner = 'bench' AND {where}")


async def end_to_end(env: Env, target: TargetProcess, *, runs: int, spread_sec: float, shape: FleetShape,
                     scenario: str, say: Say, system: str = "chimes") -> Result:
    """``runs`` one-off HTTP jobs due at one instant (``spread_sec`` 0) or spread evenly over
    ``spread_sec`` seconds, through a real fleet, until every run is recorded as succeeded."""
    dsn = await fresh_database(env, env.database("chimes"), chimes_schema=True)
    await target.reset()
    fleet = Fleet(env, dsn, shape, scenario)
    pool = await db.create_pool(dsn, max_size=2)
    try:
        await fleet.wait_ready(300.0 if shape.worker_prefix else 60.0)  # valgrind starts a worker slowly
        lead = 3.0 + runs / 20_000 + (runs / 8_000 if spread_sec else 0)  # spread: a JobSpec validated per job
        due = seed.due_instant(lead)
        url = f"{target.url}/r"

        def spec_at(i: int) -> seed.JobSpec:
            return seed.http_job("burst", seed.at(due + timedelta(seconds=spread_sec * i / runs)), url,
                                 concurrency="allow")

        one = seed.http_job("burst", seed.at(due), url, concurrency="allow")
        took = await seed.add_jobs(pool, one, runs, specs=spec_at if spread_sec else None)
        say(f"{system}: {runs:,} jobs created in {took:.1f}s, due at {due:%H:%M:%S}")
        if datetime.now(due.tzinfo) > due - timedelta(seconds=1):
            raise RuntimeError("creating the jobs took longer than the lead time")
        # the target's CPU too (reported apart: it is nobody's under test), and every process's from the
        # due instant on, apart from what the scheduler fired ahead of it (bench.fleet_model)
        meter = CpuMeter([*fleet.procs, target.proc], env.postmasters)
        meter.start()
        loop = asyncio.get_running_loop()
        at_due = loop.call_at(loop.time() + due.timestamp() - time.time(), meter.mark)
        wal_start = await pool.fetchval("SELECT pg_current_wal_lsn()")
        limit = 120 + runs / 200 + spread_sec
        await _wait_for(lambda: _done(pool, runs), limit, "every run to succeed", fleet)
        at_due.cancel()
        cpu = meter.stop()
        target_cpu = cpu.pop(target.proc.name)
        wal_end = await pool.fetchval("SELECT pg_current_wal_lsn()")
        wal_bytes = await pool.fetchval("SELECT pg_wal_lsn_diff($2::pg_lsn, $1::pg_lsn)", wal_start, wal_end)
        inspect = await wal.can_inspect(pool)
        wal_records = await wal.by_record(pool, wal_start, wal_end, per=runs, top=30) if inspect else []
        rows = await pool.fetch(LAGS)
        history_bytes = await pool.fetchval(HISTORY_BYTES)
        times, keys = await target.arrivals()
        costs = await statement_costs(env, dsn)
    finally:
        await pool.close()
        fleet.stop()
        await drop_database(env, env.database("chimes"))
    result = _result(system, scenario, runs, due, spread_sec, rows, times, keys, cpu, fleet)
    result.extra["target_cpu_sec"] = target_cpu
    result.extra["cpu_sec_from_due"] = meter.after_mark
    result.extra["wal_bytes_per_run"] = round(float(wal_bytes) / runs)  # includes the polling and idle loops
    result.extra["history_bytes_per_run"] = round(float(history_bytes) / runs)
    say(f"{system}: run history {result.extra['history_bytes_per_run']:,} bytes per run on disk "
        "(the pages of runs and run_attempts, indexes included)")
    if result.extra["first_call_sec"] is not None:
        say(f"{system}: the first call came {result.extra['first_call_sec']:.3f}s after the due instant")
    if wal_records:  # which rows and index entries a run writes (bench.wal)
        result.extra["wal_by_record_per_run"] = wal_records
        say(f"{system}: WAL per run {result.extra['wal_bytes_per_run']:,} bytes; the heaviest relations and records:")
        for line in wal.describe(wal_records, "run"):
            say(f"  {line}")
    if costs:
        result.extra["statements"] = costs
    return result


async def _done(pool: asyncpg.Pool, runs: int) -> bool:
    return await _count(pool, "status = 'succeeded'") >= runs


def _result(system: str, scenario: str, runs: int, due: datetime, spread_sec: float, rows: list[asyncpg.Record],
            times: list[float], keys: list[str], cpu: dict[str, float], fleet: Fleet) -> Result:
    t0 = due.timestamp()
    # With a spread, each run's own due time is its scheduled_at: lags come from the database.
    fire = [float(r["fire_lag"]) for r in rows if r["fire_lag"] is not None]
    start_db = [float(r["start_lag"]) for r in rows if r["start_lag"] is not None]
    arrivals = [t - t0 for t in times] if not spread_sec else start_db
    finished = [float(r["finished"]) for r in rows if r["finished"] is not None]
    result = Result(system, scenario, runs, len(finished), (max(finished) - t0) if finished else None,
                    fire_lag=percentiles(fire), start_lag=percentiles(arrivals), cpu_sec=cpu,
                    peak_mb=fleet.peaks(), start_lags=arrivals)
    result.extra = {"claim_lag": percentiles(start_db), "calls": len(times), "distinct_calls": len(set(keys)),
                    # a burst's fixed start: the fire's commit at the instant, the first claim, the first connections
                    "first_call_sec": round(min(arrivals), 4) if arrivals and not spread_sec else None,
                    "fleet": vars(fleet.shape), "warnings": fleet.warnings()}
    if spread_sec:
        result.extra["rate_per_sec"] = runs / spread_sec
        result.notes = "start lag from runs.started_at (each run's own due time)"
    return result
