"""The same burst through Chimes and through the Python schedulers a team would use instead, one
after the other in the same run, on the same PostgreSQL, calling the same local HTTP target.

Chimes runs as real ``chimes scheduler`` and ``chimes worker`` processes and keeps its whole run
history; each PostgreSQL-based peer runs in one process of its own (``bench/peer_run.py``). Celery,
what most Python teams run, needs a broker: the benchmark starts a redis-server of its own and real
``celery worker`` processes shaped like Chimes' workers (``bench/celery_peer.py``), and sends the burst
as ETA tasks (its one-off jobs; beat only sends recurring ones, which this burst has none of).

On a fresh machine the peers' packages and Celery's redis-server are installed first where they can
be (``bench/peer_setup.py``); a peer that cannot be set up is skipped with a line saying why.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson

from bench import celery_peer, chimes_runs, peer_setup, quiet
from bench.env import Env, drop_database, fresh_database
from bench.procs import CpuMeter, Proc, python
from bench.report import Result, percentiles
from bench.target import TargetProcess

PEERS = {
    "apscheduler": "APScheduler 3 (SQLAlchemy job store)",
    "procrastinate": "procrastinate",
    "pgqueuer": "PgQueuer",
    "celery": "Celery (Redis broker, ETA tasks)",
}


def _version(system: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    package = {"apscheduler": "APScheduler"}.get(system, system)
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


async def peers(env: Env, target: TargetProcess, *, runs: int, systems: list[str],
                shape: chimes_runs.FleetShape, say: Callable[[str], None],
                settle: Callable[[], Awaitable[None]] | None = None) -> list[Result]:
    """``settle``: awaited before each system, so that none starts in the load the one before left."""
    unknown = [s for s in systems if s != "chimes" and s not in PEERS]
    if unknown:
        raise SystemExit(f"unknown system {unknown[0]!r}; choose from chimes, {', '.join(PEERS)}")
    # What a peer needs is installed, or the peer skipped, before any system runs, not after the
    # others have taken minutes; the rest are measured either way.
    systems = peer_setup.prepare(systems, say)
    results = []
    records: list[quiet.Quietness] = []
    for system in systems:
        # The systems run one after the other: how quiet the machine was is recorded for each, so that
        # a ratio taken while something else ran can be told apart.
        if settle is not None:
            await settle()
        async with quiet.watch() as quietness:
            if system == "chimes":
                result = await chimes_runs.end_to_end(env, target, runs=runs, spread_sec=0, shape=shape,
                                                      scenario="peers", say=say)
            else:
                result = await run_peer(env, target, system, runs, say, shape=shape)
        result.extra["machine"] = quietness.to_json()
        say(f"{result.system}: drained {result.completed:,} runs in {result.drain_sec or 0:.2f}s; "
            f"{quietness.describe()}")
        results.append(result)
        records.append(quietness)
    spread = quiet.probe_spread(records)
    if spread:
        say(spread)
    return results


async def run_peer(env: Env, target: TargetProcess, system: str, runs: int, say: Callable[[str], None],
                   concurrency: int = 50, batch_size: int = 50,
                   shape: chimes_runs.FleetShape | None = None) -> Result:
    """``shape``: Chimes' worker fleet in the same command, which Celery's workers copy (one
    ``celery worker`` per Chimes worker, as many task bodies at once as each Chimes worker runs)."""
    shape = shape or chimes_runs.FleetShape()
    name = env.database(system)
    await target.reset()
    out = env.workdir / f"{system}.json"
    seeded = Path(f"{out}.seeded")
    _remove(seeded)
    helpers: list[Proc] = []  # the processes besides the producer that do the system's work
    broker = proc = None
    argv = ["-m", "bench.peer_run", system, "--runs", str(runs), "--url", target.url, "--out", str(out)]
    try:
        if system == "celery":
            broker = celery_peer.RedisServer(env.workdir)
            helpers.append(broker.proc)
            helpers += celery_peer.start_workers(env.workdir, broker, workers=shape.workers,
                                                 concurrency=shape.concurrency)
            argv += ["--workers", str(shape.workers)]
            meter = CpuMeter(helpers, {})  # Celery does not use PostgreSQL
        else:
            argv += ["--dsn", await fresh_database(env, name), "--concurrency", str(concurrency),
                     "--batch-size", str(batch_size)]
            meter = CpuMeter([], env.postmasters)
        proc = Proc(system, python(*argv), env.workdir / f"{system}.log",
                    celery_peer.broker_env(broker) if broker else None)
        while not _exists(seeded):
            dead = [p for p in (proc, *helpers) if not p.alive()]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited while {system} stored its jobs:\n{dead[0].log_tail()}")
            await asyncio.sleep(0.05)
        due = float(_read(seeded))
        say(f"{system}: {runs:,} jobs stored, due at {time.strftime('%H:%M:%S', time.localtime(due))}")
        if time.time() > due - 0.5:
            raise RuntimeError(f"{system} took longer to store its jobs than the lead time")
        meter.start()
        await _wait_exit(proc, helpers)
        meter.stop()
        if proc.popen.returncode != 0 or not _exists(out):
            raise RuntimeError(f"{system} failed:\n{proc.log_tail()}")
    finally:
        if proc is not None:
            proc.stop()
        for helper in reversed(helpers):
            helper.stop()
        if system != "celery":
            await drop_database(env, name)
    data = orjson.loads(_read(out))
    times, keys = await target.arrivals()
    producer = "celery producer" if system == "celery" else system
    cpu = {producer: round(data["cpu_sec"], 3), **meter.by_name}
    starts = [t - data["due"] for t in times]
    result = Result(f"{PEERS[system]} {_version(system)}", "peers", runs, len(data["finished"]),
                    data["recorded_at"] - data["due"] if data["finished"] else None,
                    start_lag=percentiles(starts), cpu_sec=cpu,
                    peak_mb={producer: round(data["peak_mb"], 1),
                             **{p.name: round(p.peak_rss_mb(), 1) for p in helpers}},
                    start_lags=starts)
    result.extra = {"settings": data["settings"], "calls": len(times), "distinct_calls": len(set(keys)),
                    "last_body_finished_sec": round(max(data["finished"]) - data["due"], 3) if data["finished"]
                    else None}
    if system == "celery":
        result.extra["settings"] |= {"workers": shape.workers, "concurrency": shape.concurrency}
    result.notes = {"apscheduler": "no run history kept",
                    "celery": "the producer only sends the tasks and polls the result backend"}.get(system, "")
    return result


async def _wait_exit(proc: Proc, helpers: list[Proc]) -> None:
    """Until the producer exits; a helper (broker, worker) that dies first stops the measurement
    rather than leave the producer waiting out its deadline."""
    if not helpers:
        await asyncio.to_thread(proc.popen.wait)
        return
    while proc.alive():
        dead = [p for p in helpers if not p.alive()]
        if dead:
            raise RuntimeError(f"{dead[0].name} exited during the burst:\n{dead[0].log_tail()}")
        await asyncio.sleep(0.1)


def _exists(path: Path) -> bool:
    return path.exists()


def _read(path: Path) -> bytes:
    return path.read_bytes()


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
