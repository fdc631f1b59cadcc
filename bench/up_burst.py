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
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import asyncpg
import httpx
import psutil

from bench import seed
from bench.api_client import team_token, wait_until
from bench.chimes_runs import LAGS
from bench.env import Env, drop_database, fresh_database, statement_costs
from bench.fleet_model import cpu_bound, machine_cores
from bench.procs import Proc, free_port, postgres_cpu_seconds, python
from bench.report import Result, percentiles
from bench.target import TargetProcess

MODES = {"processes": ["--processes"], "single-process": [],
         "2-workers": ["--processes", "--worker-processes", "2"]}
LANES = 16  # requests in flight while the jobs are created
# CPU is counted from this long before the due second: the scheduler fires a large instant up to a
# second ahead of it (SchedulerConfig.fire_ahead_sec), and that work is the burst's.
COUNT_FROM_SEC = 2.0


async def up_bursts(env: Env, target: TargetProcess, *, runs: int, rounds: int, say: Callable[[str], None],
                    modes: list[str] | None = None, profile: Path | None = None) -> list[Result]:
    """``modes``: the layouts to run (MODES' keys), alternating round by round; ``profile``: a folder
    for a py-spy profile of each burst (``py-spy`` on the PATH, and the right to attach to a process)."""
    modes = modes or list(MODES)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown --modes {', '.join(unknown)}: choose from {', '.join(MODES)}")
    if profile is not None and _py_spy() is None:
        raise SystemExit("--profile needs py-spy: pip install py-spy")
    results = []
    for n in range(rounds):
        order = modes if n % 2 == 0 else list(reversed(modes))
        for mode in order:
            into = profile / f"up-{mode}-{n + 1}.txt" if profile is not None else None
            results.append(await up_burst(env, target, mode=mode, runs=runs, say=say, profile=into))
    return results


async def up_burst(env: Env, target: TargetProcess, *, mode: str, runs: int, say: Callable[[str], None],
                   profile: Path | None = None) -> Result:
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
                workers = int(MODES[mode][-1]) if "--worker-processes" in MODES[mode] else 1
                await wait_until(lambda: _ready(conn, workers), limit_sec=60,
                                 what=f"{system}'s scheduler and workers")
                http.headers["Authorization"] = f"Bearer {await team_token(dsn, 'bench')}"
                # through the API: 230-400 a second on 2 cores, so 150 leaves room (and little idle time)
                due = seed.due_instant(10 + runs / 150)
                took = await _create(http, target.url, due, runs)
                say(f"{system}: {runs:,} jobs created through the API in {took:.1f}s, due at {due:%H:%M:%S}")
                if datetime.now(due.tzinfo).timestamp() > due.timestamp() - COUNT_FROM_SEC - 0.5:
                    raise RuntimeError("creating the jobs took longer than the lead time")
                # CPU and the profile from before the burst is fired (ahead of its second): not the idle
                # wait before it
                await asyncio.sleep(due.timestamp() - COUNT_FROM_SEC - time.time())
                if env.statements:  # the burst's statements, not the creates'
                    await conn.execute("SELECT pg_stat_statements_reset()")
                spy = _spy(up, profile) if profile is not None else None
                cpu_start = _cpu(up, env, target)
                # and again at the due second: what the drain had of the CPU, apart from the firing ahead
                at_due: dict[str, float] = {}
                loop = asyncio.get_running_loop()
                reading = loop.call_at(loop.time() + due.timestamp() - time.time(),
                                       lambda: at_due.update(_cpu(up, env, target)))
                try:
                    await wait_until(lambda: _succeeded(conn, runs, up), limit_sec=120 + runs / 100,
                                     what="every run to succeed", interval=0.25)
                    end = _cpu(up, env, target)
                    reading.cancel()
                    cpu = {k: round(v - cpu_start.get(k, 0.0), 3) for k, v in end.items() if k != "target"}
                    from_due = {k: round(v - at_due.get(k, 0.0), 3) for k, v in end.items()} if at_due else {}
                finally:
                    if spy is not None and profile is not None:
                        say(f"{system}: profile in {profile}\n" + _stop_spy(spy, profile))
                rows = await conn.fetch(LAGS.replace("owner = 'bench'", "true"))
                costs = await statement_costs(env, dsn)
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
                    "claim_lag": percentiles([float(r["start_lag"]) for r in rows if r["start_lag"] is not None]),
                    "cpu_sec_from_due": from_due, "first_call_sec": round(min(starts), 4) if starts else None}
    if result.drain_sec and from_due:
        # how much of the drain the processes' CPU accounts for: the rest they waited
        bound, bound_by = cpu_bound(from_due, machine_cores())
        result.extra["cpu_bound"] = {"sec": round(bound, 3), "set_by": bound_by,
                                     "drain_per_bound": round(result.drain_sec / bound, 3)}
        say(f"{system}: the CPU from the due second allows a drain of {bound:.2f}s at the shortest ({bound_by}): "
            f"drained in {result.drain_sec / bound:.2f} times that")
    if costs:
        result.extra["statements"] = costs
    say(f"{system}: first call {result.extra['first_call_sec'] or 0:.3f}s after the due second, start lag p50 "
        f"{_sec(result, 'p50')}, p99 {_sec(result, 'p99')}; drained in {result.drain_sec or 0:.2f}s")
    return result


def _sec(result: Result, rank: str) -> str:
    return f"{result.start_lag[rank]:.2f}s" if result.start_lag else "-"


async def _healthy(http: httpx.AsyncClient, up: Proc) -> bool:
    if not up.alive():
        raise RuntimeError(f"chimes up exited:\n{up.log_tail()}")
    with contextlib.suppress(httpx.HTTPError):
        return (await http.get("/healthz")).status_code == 200
    return False


async def _ready(conn: asyncpg.Connection, workers: int) -> bool:
    leased = await conn.fetchval(
        "SELECT count(*) FROM partition_leases WHERE owner IS NOT NULL AND expires_at > now()")
    return bool(leased == 1024 and await conn.fetchval("SELECT count(*) FROM workers") == workers)


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


def _py_spy() -> str | None:
    """py-spy beside this Python (a virtual environment's, not on the PATH), else on the PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def _spy(up: Proc, into: Path) -> subprocess.Popen[bytes]:
    into.parent.mkdir(parents=True, exist_ok=True)
    command = [_py_spy() or "py-spy", "record", "-p", str(up.pid), "--subprocesses", "-r", "500", "--format", "raw",
               "-o", str(into)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def _stop_spy(spy: subprocess.Popen[bytes], into: Path, top: int = 15) -> str:
    """Stop py-spy (it writes its samples on SIGINT); the functions most often running, by share."""
    spy.send_signal(signal.SIGINT)
    spy.wait(timeout=60)
    return "\n".join(f"    {share:5.1%}  {frame}" for frame, share in top_frames(into, top))


def top_frames(raw: Path, top: int) -> list[tuple[str, float]]:
    """From py-spy's raw (collapsed) stacks: each function's share of the samples it was running in
    (its own time: the innermost Python frame, with the C it calls), the ``top`` largest, of the
    samples py-spy took of threads it did not find idle."""
    running: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        total += int(count)
        function, _, where = stack.rsplit(";", 1)[-1].partition(" (")  # "name (path:line)"
        running[f"{function} ({Path(where.rsplit(':', 1)[0]).name})"] += int(count)
    return [(frame, n / total) for frame, n in running.most_common(top)] if total else []


def _cpu(up: Proc, env: Env, target: TargetProcess) -> dict[str, float]:
    """CPU seconds so far of chimes up, of each child it runs, of the PostgreSQL server and of the
    HTTP target."""
    found: dict[str, float] = {}
    with contextlib.suppress(psutil.NoSuchProcess):
        parent = psutil.Process(up.pid)
        children = sorted(parent.children(), key=lambda c: c.pid)
        for proc, role in itertools.chain([(parent, "up")], ((c, c.cmdline()[-1]) for c in children)):
            times = proc.cpu_times()
            label = role
            for n in itertools.count(2):
                if label not in found:
                    break
                label = f"{role} {n}"
            found[label] = times.user + times.system
    for name, pid in env.postmasters().items():
        pg = postgres_cpu_seconds(pid)
        if pg is not None:
            found[name] = pg
    found["target"] = target.proc.cpu_seconds()
    return found
