"""Bulk import: N schedules (bench/make_jobs.py: a mix of crons, zones and HTTP tasks) loaded with the
real ``chimes jobs import FILE`` command, every line validated, COPY into jobs and triggers, one
transaction. Reports jobs per second, the importer's peak memory, and the database's size after."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable

import asyncpg
import psutil

from bench import make_jobs
from bench.env import Env, drop_database, fresh_database
from bench.procs import CpuMeter, Proc, python
from bench.report import Result

SIZES = """
SELECT pg_database_size(current_database()) AS database, pg_total_relation_size('jobs') AS jobs,
       pg_total_relation_size('triggers') AS triggers, (SELECT count(*) FROM triggers) AS trigger_rows
"""


async def load(env: Env, *, jobs: int, say: Callable[[str], None]) -> Result:
    dsn = await fresh_database(env, env.database("load"), chimes_schema=True)
    source = env.workdir / "jobs.jsonl"
    started = time.perf_counter()
    with source.open("wb") as out:
        make_jobs.write(out, jobs)
    say(f"load: wrote {jobs:,} jobs ({source.stat().st_size / 2**20:,.0f} MiB) in "
        f"{time.perf_counter() - started:.0f}s; importing")
    env_vars = {"CHIMES_DATABASE_URL": dsn, "CHIMES_DATA_DIR": str(env.workdir / "chimes")}
    proc = Proc("importer", python("-m", "chimes", "jobs", "import", str(source), "--owner", "bench"),
                env.workdir / "import.log", env_vars)
    meter = CpuMeter([proc], env.postmasters)
    meter.start()
    peak = 0.0
    began = time.perf_counter()
    while proc.alive():
        try:  # the importer exits by itself: sample it, with its validating processes, while it runs
            memory, cpu_sec = _with_children(psutil.Process(proc.pid))
            peak = max(peak, memory)
            meter.by_name["importer"] = cpu_sec
        except psutil.NoSuchProcess:
            break
        await asyncio.sleep(0.2)
    wall = time.perf_counter() - began
    cpu_importer = meter.by_name.get("importer", 0.0)
    cpu = meter.stop()
    cpu["importer"] = round(cpu_importer, 1)  # what it had used when last sampled, just before it exited
    log = proc.log_tail(2000)
    proc.stop()
    if proc.popen.returncode != 0:
        raise RuntimeError(f"chimes jobs import failed:\n{log}")
    reported = re.search(r"imported (\d+) jobs in ([\d.]+)s", log)
    conn = await asyncpg.connect(dsn)
    try:
        sizes = await conn.fetchrow(SIZES)
    finally:
        await conn.close()
        await drop_database(env, env.database("load"))
    seconds = float(reported.group(2)) if reported else wall
    result = Result("chimes jobs import", "load", jobs, int(reported.group(1)) if reported else 0, seconds,
                    cpu_sec=cpu, peak_mb={"importer": round(peak, 1)})
    result.extra = {"database_mb": round(sizes["database"] / 2**20), "jobs_table_mb": round(sizes["jobs"] / 2**20),
                    "triggers_table_mb": round(sizes["triggers"] / 2**20), "triggers": sizes["trigger_rows"],
                    "process_wall_sec": round(wall, 1)}
    result.notes = (f"runs/s column = jobs imported per second; database {result.extra['database_mb']:,} MB after "
                    f"(jobs {result.extra['jobs_table_mb']:,} MB, triggers {result.extra['triggers_table_mb']:,} MB)")
    return result


def _with_children(process: psutil.Process) -> tuple[float, float]:
    """Resident MB and CPU seconds of a process and its live children (those that ended are in its
    ``children_*`` times)."""
    times = process.cpu_times()
    memory, cpu_sec = process.memory_info().rss, times.user + times.system + times.children_user + times.children_system
    for child in process.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            child_times = child.cpu_times()
            memory += child.memory_info().rss
            cpu_sec += child_times.user + child_times.system
    return memory / 2**20, cpu_sec
