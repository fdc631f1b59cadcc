"""``python -m bench ha-cost``: what the synchronous standby costs, side by side in one command.

The same burst of one-off HTTP runs (bench/chimes_runs.py: real scheduler and worker processes, the
bench target) and the same batch of API creates go through three setups, one after the other:

- one PostgreSQL, no standby (the embedded server, as in ``burst``);
- a Patroni cluster with an asynchronous standby (``synchronous_mode: false``);
- a Patroni cluster with a synchronous standby (``synchronous_mode: true``, the supported setup).

The fleet and the API are given the primary's own address, so nothing moves during a measurement.
A create is answered 201 after its commit, and in synchronous mode a commit waits for the standby
to have flushed its WAL: the create latency is what a user of the API sees of that wait.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from bench import chimes_runs
from bench.api_client import ApiProcess, team_token
from bench.chimes_runs import FleetShape
from bench.env import Env, drop_database, fresh_database
from bench.ha_setup import Say, ha_cluster, member_dsn, mode_name, roles
from bench.report import Result, percentiles
from bench.target import TargetProcess

SETUPS = ("single", "async", "sync")
LABELS = {"single": "one PostgreSQL, no standby", "async": "Patroni, asynchronous standby",
          "sync": "Patroni, synchronous standby"}
WARM_UP_CREATES = 20  # not counted: the API's first requests open its connections


async def ha_cost(env: Env, target: TargetProcess, *, runs: int, creates: int, shape: FleetShape,
                  say: Say) -> list[Result]:
    results = [await _measure(env, target, runs=runs, creates=creates, shape=shape, setup="single", say=say)]
    for synchronous in (False, True):
        async with ha_cluster(env.workdir, synchronous=synchronous, say=say) as cluster:
            primary = await asyncio.to_thread(cluster.wait_for_primary, 30)
            cluster_env = Env(member_dsn(cluster, primary, "postgres"), env.workdir, None,
                              prefix=env.prefix, servers=roles(cluster))
            setup = "sync" if synchronous else "async"
            say(f"{mode_name(synchronous)}: primary {primary.name}")
            results.append(await _measure(cluster_env, target, runs=runs, creates=creates, shape=shape,
                                          setup=setup, say=say))
    return results


async def _measure(env: Env, target: TargetProcess, *, runs: int, creates: int, shape: FleetShape, setup: str,
                   say: Say) -> Result:
    latencies = await create_latencies(env, creates, say)
    result = await chimes_runs.end_to_end(env, target, runs=runs, spread_sec=0, shape=shape, scenario="ha-cost",
                                          say=say, system=LABELS[setup])
    result.extra["setup"] = setup
    result.extra["create_latency_ms"] = percentiles([x * 1000 for x in latencies])
    result.extra["creates"] = len(latencies)
    return result


async def create_latencies(env: Env, creates: int, say: Say) -> list[float]:
    """Seconds from sending ``POST /jobs`` to its 201, one create at a time, each job due in an hour
    (none fires during the measurement), through a ``chimes api`` process on a database of its own."""
    dsn = await fresh_database(env, env.database("api"), chimes_schema=True)
    api = ApiProcess(dsn, env.workdir)
    try:
        token = await team_token(dsn)
        async with httpx.AsyncClient(base_url=api.url, headers={"Authorization": f"Bearer {token}"},
                                     timeout=30) as client:
            await api.ready(client)
            due = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
            latencies = []
            for i in range(WARM_UP_CREATES + creates):
                started = time.perf_counter()
                answer = await client.post("/jobs", json={
                    "name": f"create-{i}", "schedule": {"at": due},
                    "task": {"type": "http", "url": "http://127.0.0.1:9/never"}})
                took = time.perf_counter() - started
                if answer.status_code != 201:
                    raise RuntimeError(f"POST /jobs answered {answer.status_code}: {answer.text[:500]}")
                if i >= WARM_UP_CREATES:
                    latencies.append(took)
    finally:
        api.stop()
        await drop_database(env, env.database("api"))
    say(f"{creates} creates through the API, one at a time: p50 {sorted(latencies)[len(latencies) // 2] * 1000:.1f} ms")
    return latencies


# --- the report ------------------------------------------------------------------------------------

def cpu_ms_per_run(cpu_sec: dict[str, float], completed: int) -> dict[str, float]:
    """CPU milliseconds per run by process group: the scheduler nodes, the workers, the primary
    PostgreSQL (``postgresql`` when it is the only one) and the standby."""
    groups: dict[str, float] = {}
    for name, seconds in cpu_sec.items():
        group = ("scheduler" if name.startswith("scheduler") else "workers" if name.startswith("worker")
                 else "primary" if name in ("postgresql", "primary") else name)
        groups[group] = groups.get(group, 0.0) + seconds
    return {group: seconds / completed * 1000 for group, seconds in groups.items()} if completed else {}


def cost_rows(results: Sequence[Result]) -> list[dict[str, Any]]:
    """One row of figures per setup, with each setup's ratio to the first (one PostgreSQL)."""
    rows = []
    for r in results:
        cpu = cpu_ms_per_run(r.cpu_sec, r.completed)
        rows.append({"setup": r.system, "runs": r.completed, "runs_per_sec": r.throughput,
                     "start_lag": r.start_lag, "create_latency_ms": r.extra.get("create_latency_ms"),
                     "cpu_ms_per_run": cpu, "cpu_ms_per_run_total": sum(cpu.values()),
                     "wal_bytes_per_run": r.extra.get("wal_bytes_per_run")})
    base = rows[0] if rows else None
    for row in rows:
        row["vs_single"] = _ratios(row, base)
    return rows


def _ratios(row: dict[str, Any], base: dict[str, Any] | None) -> dict[str, float | None]:
    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else round(a / b, 2)

    def p50(summary: dict[str, float] | None) -> float | None:
        return None if summary is None else summary["p50"]

    if base is None:
        return {}
    return {"runs_per_sec": ratio(row["runs_per_sec"], base["runs_per_sec"]),
            "create_latency_p50": ratio(p50(row["create_latency_ms"]), p50(base["create_latency_ms"])),
            "cpu_ms_per_run": ratio(row["cpu_ms_per_run_total"], base["cpu_ms_per_run_total"]),
            "wal_bytes_per_run": ratio(row["wal_bytes_per_run"], base["wal_bytes_per_run"])}


def cost_table(results: Sequence[Result]) -> str:
    headers = ["setup", "runs/s", "start lag p50/p99 s", "create p50/p99 ms",
               "CPU ms/run: scheduler, workers, primary, standby = total", "WAL B/run", "vs one PostgreSQL"]
    lines = []
    for row in cost_rows(results):
        cpu = row["cpu_ms_per_run"]
        lag, create, ratios = row["start_lag"], row["create_latency_ms"], row["vs_single"]
        lines.append([
            row["setup"], "-" if row["runs_per_sec"] is None else f"{row['runs_per_sec']:,.0f}",
            "-" if lag is None else f"{lag['p50']:.2f} / {lag['p99']:.2f}",
            "-" if create is None else f"{create['p50']:.1f} / {create['p99']:.1f}",
            ", ".join(f"{cpu.get(g, 0.0):.3f}" for g in ("scheduler", "workers", "primary", "standby"))
            + f" = {row['cpu_ms_per_run_total']:.3f}",
            "-" if row["wal_bytes_per_run"] is None else f"{row['wal_bytes_per_run']:,}",
            f"runs/s x{ratios.get('runs_per_sec')}, create p50 x{ratios.get('create_latency_p50')}, "
            f"CPU x{ratios.get('cpu_ms_per_run')}",
        ])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]
    out = [" | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)), "-+-".join("-" * w for w in widths)]
    out += [" | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join(out)
