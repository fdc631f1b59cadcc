"""``python -m bench async-loss``: what a failover loses with an asynchronous standby, and with a
synchronous one (nothing), side by side in one command.

For each mode a Patroni cluster of two PostgreSQL members (bench/ha_setup.py) runs a scheduler node,
a worker and the API, all given every member's address (``target_session_attrs=read-write``), as in
production. In each round, writers create one-off jobs through the API as fast as it answers (each
due a second later, so runs are fired, claimed and delivered to the bench target all along), and
every 201 is recorded with the job's id. Then the primary's PostgreSQL and Patroni are SIGKILLed
(the host is gone), Patroni promotes the standby (about its TTL, 20 s, later), writes are accepted
again, and once the fleet has settled (no run left scheduled or running) the new primary is asked:

- acknowledged jobs missing: answered 201, not there;
- delivered runs missing: the target received the call (so the run was fired and claimed, and the
  fire committed), its run is not there; the trigger that fired it is back, so it fires again;
- jobs executed twice: the target was called twice for one job (its one slot): a lost fire, claim
  or recorded outcome makes Chimes run the slot again.

The killed member is started again (it rejoins through pg_rewind) before the next round.

On one machine the standby is never more than a few milliseconds behind, so a plain kill loses
little or nothing even asynchronously. Between zones the link stalls now and then; with
``--standby-stall SEC`` each mode also runs rounds in which the primary's WAL sender is stopped
(SIGSTOP) that long before the kill, while writes go on: the standby receives nothing more, as over
a stalled link (stopping the standby's receiver instead would not do: what the sender had written
waits in the socket's buffers and arrives after all). That is what an asynchronous standby loses
when the primary dies during such a stall, and what a synchronous one (whose commits wait for it)
does not.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import asyncpg
import httpx
import psutil

from bench.api_client import ApiProcess, Write, Writer, team_token, wait_until
from bench.chimes_runs import Fleet, FleetShape
from bench.env import Env
from bench.ha_setup import Say, ha_cluster, member_dsn, mode_name
from bench.report import Result, percentiles
from bench.target import TargetProcess
from chimes.ha.cluster import HaCluster
from chimes.store.embedded import DATABASE
from chimes.store.migrate import migrate

FLOW_WRITES = 300  # acknowledged writes before the kill: writes are flowing at full speed
SETTLE_SEC = 150.0  # a lost claim or outcome is run again once its run lease (30 s) expires


@dataclass
class LossRound:
    """One failover: what was acknowledged before it and what the new primary is missing."""

    mode: str  # "async" or "sync"
    outage_sec: float  # from the kill to the new primary
    acknowledged: int  # jobs answered 201 in the round
    ack_per_sec: float  # acknowledged writes per second in the 2 s before the kill
    lost_jobs: int
    lost_jobs_window_ms: float | None  # from the first lost job's 201 to the kill
    delivered: int  # runs delivered before the kill
    lost_runs: int  # delivered, and missing on the new primary
    lost_runs_window_ms: float | None  # from the first lost run's delivery to the kill
    executed_twice: int  # jobs whose task was called more than once
    # How far the standby was behind while writes flowed (sampled on the primary every 50 ms): what a
    # failover at that instant could lose in asynchronous mode, what a commit waits for in synchronous
    standby_behind_bytes: dict[str, float] | None = None
    standby_flush_lag_ms: dict[str, float] | None = None
    stall_sec: float = 0.0  # the primary's WAL sender stopped this long before the kill


def count_losses(*, mode: str, kill_at: float, promoted_at: float, writes: Sequence[Write], jobs_found: set[str],
                 deliveries: Sequence[tuple[float, str, str]], runs_found: set[str]) -> LossRound:
    """The round's figures from what the writer and the target recorded (wall-clock seconds) and the
    job and run ids the new primary has. Pure: no clock, no I/O."""
    acked = [w for w in writes if w.job_id is not None]
    lost = [w for w in acked if w.job_id not in jobs_found]
    recent = [w for w in acked if kill_at - 2.0 <= w.ended <= kill_at]
    before = [d for d in deliveries if d[0] <= kill_at]
    lost_runs = {run_id: at for at, run_id, _ in reversed(before) if run_id not in runs_found}
    per_job = Counter(path for _, _, path in deliveries)
    return LossRound(
        mode=mode, outage_sec=round(promoted_at - kill_at, 2), acknowledged=len(acked),
        ack_per_sec=len(recent) / 2.0, lost_jobs=len(lost),
        lost_jobs_window_ms=_window_ms(kill_at, [w.ended for w in lost]),
        delivered=len({run_id for _, run_id, _ in before}), lost_runs=len(lost_runs),
        lost_runs_window_ms=_window_ms(kill_at, list(lost_runs.values())),
        executed_twice=sum(1 for n in per_job.values() if n > 1))


def _window_ms(kill_at: float, times: list[float]) -> float | None:
    """How long before the kill the earliest of ``times`` was (0 when it came after the kill)."""
    return round(max(0.0, kill_at - min(times)) * 1000, 1) if times else None


def summarise(rounds: Sequence[LossRound]) -> dict[str, dict[str, Any]]:
    """Per mode: failovers, the total and largest loss per failover, and the widest window."""
    out: dict[str, dict[str, Any]] = {}
    for mode in dict.fromkeys(_kind(r) for r in rounds):
        mine = [r for r in rounds if _kind(r) == mode]
        windows = [r.lost_jobs_window_ms for r in mine if r.lost_jobs_window_ms is not None]
        out[mode] = {
            "failovers": len(mine),
            "acknowledged": sum(r.acknowledged for r in mine),
            "lost_jobs": sum(r.lost_jobs for r in mine),
            "lost_jobs_per_failover": round(sum(r.lost_jobs for r in mine) / len(mine), 2),
            "most_lost_jobs": max(r.lost_jobs for r in mine),
            "widest_window_ms": max(windows) if windows else None,
            "lost_runs": sum(r.lost_runs for r in mine),
            "executed_twice": sum(r.executed_twice for r in mine),
            "ack_per_sec": round(sum(r.ack_per_sec for r in mine) / len(mine), 1),
        }
    return out


def _kind(r: LossRound) -> str:
    """The mode, and the stall when there was one: ``async``, ``async, standby stalled 0.5 s``."""
    return r.mode + (f", standby stalled {r.stall_sec:g} s" if r.stall_sec else "")


def _behind(r: LossRound) -> str:
    size, lag = r.standby_behind_bytes, r.standby_flush_lag_ms
    return (("-" if size is None else f"{size['p50'] / 1024:.1f}/{size['max'] / 1024:.1f} KB") + ", "
            + ("-" if lag is None else f"{lag['p50']:.1f}/{lag['max']:.1f} ms"))


def rounds_of(results: Sequence[Result]) -> list[LossRound]:
    """The rounds kept in :func:`async_loss`'s results (their JSON)."""
    return [LossRound(**r) for result in results for r in result.extra.get("rounds", [])]


def loss_table(rounds: Sequence[LossRound]) -> str:
    headers = ["mode", "outage s", "acked", "acked/s at the kill", "lost jobs (window ms)",
               "delivered", "lost runs (window ms)", "executed twice", "standby behind p50/max: KB, flush lag ms"]
    lines = [[mode_name(r.mode == "sync") + (f", standby stalled {r.stall_sec:g} s" if r.stall_sec else ""),
              f"{r.outage_sec:.1f}", f"{r.acknowledged:,}", f"{r.ack_per_sec:.0f}",
              f"{r.lost_jobs}" + (f" ({r.lost_jobs_window_ms:.0f})" if r.lost_jobs_window_ms is not None else ""),
              f"{r.delivered:,}",
              f"{r.lost_runs}" + (f" ({r.lost_runs_window_ms:.0f})" if r.lost_runs_window_ms is not None else ""),
              f"{r.executed_twice}", _behind(r)] for r in rounds]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]
    out = [" | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)), "-+-".join("-" * w for w in widths)]
    out += [" | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    for mode, s in summarise(rounds).items():
        name = mode_name(mode.startswith("sync")) + mode.partition(",")[1] + mode.partition(",")[2]
        out.append(f"  {name}: {s['lost_jobs']} of {s['acknowledged']:,} acknowledged jobs "
                   f"lost in {s['failovers']} failovers ({s['lost_jobs_per_failover']} per failover, at most "
                   f"{s['most_lost_jobs']}; widest window {s['widest_window_ms']} ms), {s['lost_runs']} delivered "
                   f"runs lost, {s['executed_twice']} jobs executed twice")
    return "\n".join(out)


# --- the measurement -------------------------------------------------------------------------------

async def async_loss(env: Env, target: TargetProcess, *, rounds: int, lanes: int, say: Say,
                     stall_sec: float = 0.0) -> list[Result]:
    found: list[LossRound] = []
    for synchronous in (False, True):
        async with ha_cluster(env.workdir, synchronous=synchronous, say=say) as cluster:
            found += await _rounds(env, cluster, target, rounds=rounds, lanes=lanes, synchronous=synchronous, say=say,
                                   stall_sec=stall_sec)
    return [Result(mode, "async-loss", s["acknowledged"], s["acknowledged"], None,
                   extra={"summary": s, "rounds": [asdict(r) for r in found if _kind(r) == mode]})
            for mode, s in summarise(found).items()]


async def _rounds(env: Env, cluster: HaCluster, target: TargetProcess, *, rounds: int, lanes: int,
                  synchronous: bool, say: Say, stall_sec: float = 0.0) -> list[LossRound]:
    dsn = cluster.database_url()  # every member: the roles move to the new primary as in production
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        await migrate(conn)
    finally:
        await conn.close()
    token = await team_token(dsn)
    mode = "sync" if synchronous else "async"
    fleet = Fleet(env, dsn, FleetShape(1, 1, 200), f"loss-{mode}")
    api: ApiProcess | None = None
    found = []
    try:
        await fleet.wait_ready()
        api = ApiProcess(dsn, env.workdir, f"api-{mode}")
        async with httpx.AsyncClient(base_url=api.url, headers={"Authorization": f"Bearer {token}"},
                                     timeout=30) as client:
            await api.ready(client)
            stalls = [0.0] + ([stall_sec] if stall_sec > 0 else [])
            for n, stall in ((n, stall) for stall in stalls for n in range(rounds)):
                found.append(await _one_failover(cluster, dsn, client, target, lanes=lanes, mode=mode,
                                                 prefix=f"r{n + 1}s{stall:g}", say=say, stall_sec=stall))
                restarted = await asyncio.to_thread(cluster.restart_dead)
                await asyncio.to_thread(cluster.wait_for_standbys, 180)
                say(f"{mode} round {n + 1}: {found[-1].lost_jobs} jobs, {found[-1].lost_runs} runs lost; "
                    f"{', '.join(restarted)} rejoined")
        dead = [p.name for p in fleet.procs if not p.alive()]
        if dead:
            raise RuntimeError(f"{dead[0]} exited during the failovers")
    finally:
        if api is not None:
            api.stop()
        fleet.stop()
    return found


async def _one_failover(cluster: HaCluster, dsn: str, client: httpx.AsyncClient, target: TargetProcess, *,
                        lanes: int, mode: str, prefix: str, say: Say, stall_sec: float = 0.0) -> LossRound:
    await target.reset()
    writer = Writer(client, target.url, pace=0, lanes=lanes, prefix=prefix)
    primary = await asyncio.to_thread(cluster.wait_for_primary, 30)
    samples: list[tuple[float, float | None]] = []
    sampler = asyncio.create_task(_sample_standby(member_dsn(cluster, primary, DATABASE), samples))
    try:
        await writer.start(first=FLOW_WRITES)
        timeline = (primary.state() or {}).get("timeline", 0)
        if stall_sec > 0:
            os.kill(_wal_sender(primary), signal.SIGSTOP)  # the link to the standby stalls; writes go on
            await asyncio.sleep(stall_sec)  # how long the stall lasts: a span of time, not a condition
        kill_at = time.time()
        sampler.cancel()
        primary.kill()
        say(f"{mode}: killed the primary {primary.name} after {len(writer.acknowledged)} acknowledged writes")
        await asyncio.to_thread(cluster.wait_for_primary, 120, after_timeline=timeline)
        promoted_at = time.time()
        await writer.accepted_after(promoted_at, "promotion", limit_sec=60)
    finally:
        sampler.cancel()
        await writer.stop()
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        await wait_until(lambda: _settled(conn, writer.acknowledged), limit_sec=SETTLE_SEC,
                         what="every run to finish after the failover", interval=0.5)
        jobs = {str(r[0]) for r in await conn.fetch("SELECT job_id FROM jobs WHERE job_id = ANY($1::uuid[])",
                                                   writer.acknowledged)}
        deliveries = await target.deliveries()
        runs = {str(r[0]) for r in await conn.fetch("SELECT run_id FROM runs WHERE run_id = ANY($1::uuid[])",
                                                   list({d[1] for d in deliveries}))}
    finally:
        await conn.close()
    found = count_losses(mode=mode, kill_at=kill_at, promoted_at=promoted_at, writes=writer.writes,
                         jobs_found=jobs, deliveries=deliveries, runs_found=runs)
    found.stall_sec = stall_sec
    found.standby_behind_bytes = percentiles([behind for behind, _ in samples])
    found.standby_flush_lag_ms = percentiles([lag * 1000 for _, lag in samples if lag is not None])
    return found


def _wal_sender(primary: Any) -> int:
    """The pid of the primary's WAL sender (its one standby's)."""
    postmaster = primary.postmaster_pid()
    if postmaster is not None:
        for child in psutil.Process(postmaster).children():
            if "walsender" in " ".join(child.cmdline()):
                return int(child.pid)
    raise RuntimeError(f"no WAL sender found on the primary {primary.name}")


async def _sample_standby(dsn: str, samples: list[tuple[float, float | None]]) -> None:
    """Every 50 ms until cancelled: the WAL bytes the standby has not flushed yet, and its flush lag
    (the time from a local flush to the standby's report of its own, as PostgreSQL measures it)."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        while True:
            row = await conn.fetchrow(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), flush_lsn) AS behind, "
                "extract(epoch FROM flush_lag) AS lag FROM pg_stat_replication LIMIT 1")
            if row is not None and row["behind"] is not None:
                samples.append((float(row["behind"]), None if row["lag"] is None else float(row["lag"])))
            await asyncio.sleep(0.05)  # a sampling period, not a wait for a condition
    finally:
        conn.terminate()


async def _settled(conn: asyncpg.Connection, acknowledged: list[str]) -> bool:
    """No run scheduled or running, and every acknowledged job that survived has run."""
    return not await conn.fetchval("""
        SELECT EXISTS (SELECT 1 FROM runs WHERE status IN ('scheduled', 'running'))
            OR EXISTS (SELECT 1 FROM jobs j WHERE j.job_id = ANY($1::uuid[])
                       AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.job_id = j.job_id AND r.status = 'succeeded'))
        """, acknowledged)
