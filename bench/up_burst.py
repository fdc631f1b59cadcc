"""``python -m bench up``: the burst a new user meets first. N one-off HTTP jobs created through the
API of a plain ``chimes up`` (its defaults: worker concurrency, limits), all due in the same second,
calling the benchmark's HTTP target; the start lag from the target's clock, the fire lag from the run
records.

Each round runs ``chimes up`` as it starts by default (every role in one process) and with
``--processes`` (the scheduler and the worker as child processes), one after the other, the order
alternating from round to round, on a fresh database of the same PostgreSQL: a ratio between the two
is taken side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import Callable
from datetime import datetime

import asyncpg
import httpx
import psutil

from bench import seed
from bench.api_client import team_token, wait_until
from bench.chimes_runs import LAGS
from bench.env import Env, drop_database, fresh_database
from bench.procs import Proc, free_port, postgres_cpu_seconds, python
from bench.report import Result, percentiles
from bench.target import TargetProcess

MODES = {"processes": ["--processes"], "single-process": []}
LANES = 16  # requests in flight while the jobs are created


async def up_bursts(env: Env, target: TargetProcess, *, runs: int, rounds: int,
                    say: Callable[[str], None]) -> list[Result]:
    results = []
    for n in range(rounds):
        order = list(MODES) if n % 2 == 0 else list(reversed(MODES))
        for mode in order:
            results.append(await up_burst(env, target, mode=mode, runs=runs, say=say))
    return results


async def up_burst(env: Env, target: TargetProcess, *, mode: str, runs: int, say: Callable[[str], None]) -> Result:
    name = env.database("up")
    dsn = await fresh_database(env, name)
    await target.reset()
    base = f"http://127.0.0.1:{free_port()}"
    up = Proc(f"up-{mode}", python("-m", "chimes", "up", "--host", "127.0.0.1", "--port", base.rsplit(":", 1)[1],
                                   *MODES[mode]), env.workdir / f"up-{mode}.log",
              {"CHIMES_DATABASE_URL": dsn, "CHIMES_DATA_DIR": str(env.workdir / "chimes"),
               "CHIMES_LOG_FORMAT": "json",
               # the one default changed: an owner's 10,000 jobs, which a burst of 20,000 would exceed
               "CHIMES_DEFAULT_JOB_QUOTA": "0"})
    system = f"chimes up ({mode})"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            await wait_until(lambda: _healthy(http, up), limit_sec=90, what=f"{system} to answer", interval=0.2)
            conn = await asyncpg.connect(dsn)
            try:
                await wait_until(lambda: _ready(conn), limit_sec=60, what=f"{system}'s scheduler and worker")
                http.headers["Authorization"] = f"Bearer {await team_token(dsn, 'bench')}"
                due = seed.due_instant(10 + runs / 60)  # through the API: 60 a second on a busy 2 cores, or more
                took = await _create(http, target.url, due, runs)
                say(f"{system}: {runs:,} jobs created through the API in {took:.1f}s, due at {due:%H:%M:%S}")
                if datetime.now(due.tzinfo).timestamp() > due.timestamp() - 1:
                    raise RuntimeError("creating the jobs took longer than the lead time")
                cpu_start = _cpu(up, env)
                await wait_until(lambda: _succeeded(conn, runs, up), limit_sec=120 + runs / 100,
                                 what="every run to succeed", interval=0.25)
                cpu = {k: round(v - cpu_start.get(k, 0.0), 3) for k, v in _cpu(up, env).items()}
                rows = await conn.fetch(LAGS.replace("owner = 'bench'", "true"))
            finally:
                await conn.close()
        times, keys = await target.arrivals()
    finally:
        up.stop(timeout=60)
        await drop_database(env, name)
    t0 = due.timestamp()
    finished = [float(r["finished"]) for r in rows if r["finished"] is not None]
    starts = [t - t0 for t in times]
    result = Result(system, "up", runs, len(finished), (max(finished) - t0) if finished else None,
                    fire_lag=percentiles([float(r["fire_lag"]) for r in rows if r["fire_lag"] is not None]),
                    start_lag=percentiles(starts), cpu_sec=cpu, start_lags=starts)
    result.extra = {"calls": len(times), "distinct_calls": len(set(keys)), "create_sec": round(took, 2),
                    "claim_lag": percentiles([float(r["start_lag"]) for r in rows if r["start_lag"] is not None])}
    say(f"{system}: start lag p50 {_sec(result, 'p50')}, p99 {_sec(result, 'p99')}; drained in "
        f"{result.drain_sec or 0:.2f}s")
    return result


def _sec(result: Result, rank: str) -> str:
    return f"{result.start_lag[rank]:.2f}s" if result.start_lag else "-"


async def _healthy(http: httpx.AsyncClient, up: Proc) -> bool:
    if not up.alive():
        raise RuntimeError(f"chimes up exited:\n{up.log_tail()}")
    with contextlib.suppress(httpx.HTTPError):
        return (await http.get("/healthz")).status_code == 200
    return False


async def _ready(conn: asyncpg.Connection) -> bool:
    leased = await conn.fetchval(
        "SELECT count(*) FROM partition_leases WHERE owner IS NOT NULL AND expires_at > now()")
    return bool(leased == 1024 and await conn.fetchval("SELECT count(*) FROM workers") == 1)


async def _succeeded(conn: asyncpg.Connection, runs: int, up: Proc) -> bool:
    if not up.alive():
        raise RuntimeError(f"chimes up exited during the burst:\n{up.log_tail()}")
    return bool(await conn.fetchval("SELECT count(*) FROM runs WHERE status = 'succeeded'") >= runs)


async def _create(http: httpx.AsyncClient, target_url: str, due: datetime, runs: int) -> float:
    """``runs`` one-off jobs due at ``due`` through ``POST /jobs``, ``LANES`` requests at once."""
    numbers = iter(range(runs))
    started = time.monotonic()

    async def lane() -> None:
        for n in numbers:
            answer = await http.post("/jobs", headers={"Idempotency-Key": str(uuid.uuid4())}, json={
                "name": f"burst-{n}", "schedule": seed.at(due), "concurrency": "allow",
                "task": {"type": "http", "url": f"{target_url}/r{n}"}})
            if answer.status_code != 201:
                raise RuntimeError(f"POST /jobs answered {answer.status_code}: {answer.text[:300]}")

    await asyncio.gather(*(lane() for _ in range(LANES)))
    return time.monotonic() - started


def _cpu(up: Proc, env: Env) -> dict[str, float]:
    """CPU seconds so far of chimes up, of each child it runs, and of the PostgreSQL server."""
    found: dict[str, float] = {}
    with contextlib.suppress(psutil.NoSuchProcess):
        parent = psutil.Process(up.pid)
        for proc, label in itertools.chain([(parent, "up")], ((c, c.cmdline()[-1]) for c in parent.children())):
            times = proc.cpu_times()
            found[label] = times.user + times.system
    for name, pid in env.postmasters().items():
        pg = postgres_cpu_seconds(pid)
        if pg is not None:
            found[name] = pg
    return found
