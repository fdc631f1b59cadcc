"""``idle-wal``: the WAL an idle fleet writes, by relation and kind of record, and the CPU it spends.

Scheduler nodes renew their partition leases and workers heartbeat whether or not anything is due,
and every byte of WAL goes to each standby and to the archive. The fleet (real processes) runs with
nothing to do; after it has settled, the WAL written over ``--duration`` seconds is broken down with
``pg_walinspect`` (a contrib extension: the embedded server has it; another server needs it
installed and a superuser).
"""

from __future__ import annotations

import asyncio

import asyncpg

from bench.chimes_runs import Fleet, FleetShape, Say
from bench.env import Env, drop_database, fresh_database
from bench.procs import CpuMeter
from bench.report import Result
from bench.wal import by_record, can_inspect, describe

SETTLE_SEC = 15.0  # the first autoanalyze of a fresh database's tables comes and goes
ANALYZED = "SELECT relname, autoanalyze_count FROM pg_stat_all_tables WHERE autoanalyze_count > 0"


async def idle_wal(env: Env, *, duration: float, shape: FleetShape, say: Say, top: int = 8,
                   settle_sec: float = SETTLE_SEC) -> Result:
    dsn = await fresh_database(env, env.database("chimes"), chimes_schema=True)
    fleet = Fleet(env, dsn, shape, "idle-wal")
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=2)
    try:
        if not await can_inspect(pool):
            raise RuntimeError("idle-wal needs pg_walinspect (a superuser, and the contrib extension installed)")
        await fleet.wait_ready()
        say(f"fleet ready; settling for {settle_sec:.0f} s, then measuring {duration:.0f} s")
        await asyncio.sleep(settle_sec)
        analyzed_before = dict(await pool.fetch(ANALYZED))
        meter = CpuMeter(fleet.procs, env.postmasters)
        meter.start()
        start = await pool.fetchval("SELECT pg_current_wal_lsn()")
        await asyncio.sleep(duration)
        end = await pool.fetchval("SELECT pg_current_wal_lsn()")
        cpu = meter.stop()
        analyzed = {name: count - analyzed_before.get(name, 0) for name, count in await pool.fetch(ANALYZED)}
        total = float(await pool.fetchval("SELECT pg_wal_lsn_diff($2::pg_lsn, $1::pg_lsn)", start, end))
        breakdown = await by_record(pool, start, end, per=duration, top=top)
    finally:
        await pool.close()
        fleet.stop()
        await drop_database(env, env.database("chimes"))
    return Result("chimes", "idle-wal", 0, 0, None, peak_mb=fleet.peaks(), cpu_sec=cpu,
                  extra={"wal_bytes_per_sec": round(total / duration), "by_record": breakdown,
                         "cpu_sec_per_sec": {name: round(sec / duration, 4) for name, sec in cpu.items()},
                         "gb_per_day": round(total / duration * 86_400 / 1e9, 2),
                         "autoanalyzed": {name: n for name, n in sorted(analyzed.items()) if n}})


def wal_table(result: Result) -> str:
    extra = result.extra
    lines = [f"WAL written by an idle fleet: {extra['wal_bytes_per_sec'] / 1024:,.1f} KB/s "
             f"({extra['gb_per_day']} GB a day)", *describe(extra["by_record"], "s")]
    lines.append("tables autoanalyzed meanwhile: " + (", ".join(f"{name} ({n})" for name, n in
                                                               extra["autoanalyzed"].items()) or "none"))
    lines.append("CPU seconds a second: " + ", ".join(f"{name} {sec:.4f}" for name, sec in
                                                     extra["cpu_sec_per_sec"].items()))
    return "\n".join(lines)
