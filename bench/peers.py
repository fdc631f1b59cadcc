"""The same burst through Chimes and through the Python schedulers a team would use instead, one
after the other in the same run, on the same PostgreSQL, calling the same local HTTP target.

Chimes runs as real ``chimes scheduler`` and ``chimes worker`` processes and keeps its whole run
history; each peer runs in one process of its own (``bench/peer_run.py``). Celery beat is left out:
it needs a message broker (Redis or RabbitMQ) that the other systems do not, so its numbers would
measure the broker as much as the scheduler.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import orjson

from bench import chimes_runs
from bench.env import Env, drop_database, fresh_database
from bench.procs import CpuMeter, Proc, python
from bench.report import Result, percentiles
from bench.target import TargetProcess

PEERS = {
    "apscheduler": "APScheduler 3 (SQLAlchemy job store)",
    "procrastinate": "procrastinate",
    "pgqueuer": "PgQueuer",
}


def _version(system: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    package = {"apscheduler": "APScheduler"}.get(system, system)
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


async def peers(env: Env, target: TargetProcess, *, runs: int, systems: list[str],
                shape: chimes_runs.FleetShape, say: Callable[[str], None]) -> list[Result]:
    results = []
    for system in systems:
        if system == "chimes":
            result = await chimes_runs.end_to_end(env, target, runs=runs, spread_sec=0, shape=shape,
                                                  scenario="peers", say=say)
        elif system in PEERS:
            result = await run_peer(env, target, system, runs, say)
        else:
            raise SystemExit(f"unknown system {system!r}; choose from chimes, {', '.join(PEERS)}")
        say(f"{result.system}: drained {result.completed:,} runs in {result.drain_sec or 0:.2f}s")
        results.append(result)
    return results


async def run_peer(env: Env, target: TargetProcess, system: str, runs: int, say: Callable[[str], None],
                   concurrency: int = 50, batch_size: int = 50) -> Result:
    if _version(system) == "not installed":
        raise SystemExit(f"{system} is not installed: pip install -e '.[bench]'")
    name = env.database(system)
    dsn = await fresh_database(env, name)
    await target.reset()
    out = env.workdir / f"{system}.json"
    seeded = Path(f"{out}.seeded")
    _remove(seeded)
    proc = Proc(system, python("-m", "bench.peer_run", system, "--dsn", dsn, "--runs", str(runs), "--url",
                               target.url, "--out", str(out), "--concurrency", str(concurrency),
                               "--batch-size", str(batch_size)), env.workdir / f"{system}.log")
    meter = CpuMeter([], env.postmasters)
    try:
        while not _exists(seeded):
            if not proc.alive():
                raise RuntimeError(f"{system} exited while storing its jobs:\n{proc.log_tail()}")
            await asyncio.sleep(0.05)
        due = float(_read(seeded))
        say(f"{system}: {runs:,} jobs stored, due at {time.strftime('%H:%M:%S', time.localtime(due))}")
        if time.time() > due - 0.5:
            raise RuntimeError(f"{system} took longer to store its jobs than the lead time")
        meter.start()
        await asyncio.to_thread(proc.popen.wait)
        meter.stop()
        if proc.popen.returncode != 0 or not _exists(out):
            raise RuntimeError(f"{system} failed:\n{proc.log_tail()}")
    finally:
        proc.stop()
        await drop_database(env, name)
    data = orjson.loads(_read(out))
    times, keys = await target.arrivals()
    cpu = {system: round(data["cpu_sec"], 3), **meter.by_name}
    starts = [t - data["due"] for t in times]
    result = Result(f"{PEERS[system]} {_version(system)}", "peers", runs, len(data["finished"]),
                    data["recorded_at"] - data["due"] if data["finished"] else None,
                    start_lag=percentiles(starts), cpu_sec=cpu, peak_mb={system: round(data["peak_mb"], 1)},
                    start_lags=starts)
    result.extra = {"settings": data["settings"], "calls": len(times), "distinct_calls": len(set(keys)),
                    "last_body_finished_sec": round(max(data["finished"]) - data["due"], 3) if data["finished"]
                    else None}
    result.notes = "no run history kept" if system == "apscheduler" else ""
    return result


def _exists(path: Path) -> bool:
    return path.exists()


def _read(path: Path) -> bytes:
    return path.read_bytes()


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
