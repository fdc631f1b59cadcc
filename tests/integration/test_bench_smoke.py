"""The benchmark code keeps working: the burst, top-of-hour and idle-wal scenarios, tiny, on the test server.

Real `chimes scheduler` and `chimes worker` processes and the benchmark's own HTTP target, as in a
real benchmark run; no timing is asserted (the machine is shared), only that every run is accounted
for and the report can be written.

The peers (`python -m bench peers`) are not run here: they come with the `bench` extra (APScheduler,
procrastinate, PgQueuer, Celery) and Celery with a redis-server, none of which the test install has.
"""

from __future__ import annotations

import os
from pathlib import Path

import orjson

from bench.__main__ import _parser, _quietness, _run
from bench.chimes_runs import FleetShape, end_to_end
from bench.env import Env
from bench.idle_wal import idle_wal, wal_table
from bench.report import spread_table, table
from bench.target import TargetProcess
from bench.top_of_hour import top_of_hour


async def test_burst_scenario_runs_every_job_once_and_reports(server_dsn: str, tmp_path: Path) -> None:
    env = Env(server_dsn, tmp_path, None, prefix=f"bench_smoke_{os.getpid()}")
    target = TargetProcess(tmp_path)
    try:
        result = await end_to_end(env, target, runs=30, spread_sec=0, shape=FleetShape(concurrency=10),
                                  scenario="burst", say=lambda _: None)
    finally:
        target.stop()
    assert (result.runs, result.completed) == (30, 30)
    assert result.extra["calls"] == result.extra["distinct_calls"] == 30  # each job called its target once
    assert result.start_lag is not None and result.fire_lag is not None
    assert set(result.peak_mb) == {"scheduler", "worker"} and all(mb > 0 for mb in result.peak_mb.values())
    assert "30/30" in table([result])
    # the WAL a run wrote, by relation and record (pg_walinspect): the run rows among them
    assert any(r["relation"].startswith("runs") and r["records"] > 0 for r in result.extra["wal_by_record_per_run"])
    assert orjson.loads(orjson.dumps(result.to_json()))["runs"] == 30


async def test_top_of_hour_scenario_fires_every_recurring_job_over_idle_schedules(server_dsn: str,
                                                                                 tmp_path: Path) -> None:
    env = Env(server_dsn, tmp_path, None, prefix=f"bench_smoke_{os.getpid()}")
    first, second = await top_of_hour(env, runs=40, idle=500, shape=FleetShape(), say=lambda _: None, rounds=2)
    assert (first.completed, second.completed) == (40, 40)
    # each fired job moved on to its next slot, none lost
    assert (first.extra["triggers_in_index"], second.extra["triggers_in_index"]) == (540, 580)
    # what each fire cost is reported: CPU by process, and the WAL it wrote
    assert first.extra["wal_bytes_per_fire"] > 0 and first.extra["wal_records_per_fire"] > 0
    assert first.extra["cpu_ms_per_fire"]["scheduler"] > 0 and "full_page_images_per_fire" in first.extra


async def test_idle_wal_scenario_breaks_an_idle_fleet_s_wal_down(server_dsn: str, tmp_path: Path) -> None:
    env = Env(server_dsn, tmp_path, None, prefix=f"bench_smoke_{os.getpid()}")
    result = await idle_wal(env, duration=3, shape=FleetShape(), say=lambda _: None, settle_sec=1)
    records = {(r["relation"], r["record"]): r["records"] for r in result.extra["by_record"]}
    # the node renews its 1,024 partitions every second, each in place (migration 0009)
    assert records.get(("partition_leases", "HOT_UPDATE"), 0) > 500, records
    assert ("partition_leases", "UPDATE") not in records, records
    assert result.extra["wal_bytes_per_sec"] > 0 and "partition_leases | HOT_UPDATE" in wal_table(result)


async def test_every_round_of_a_repeated_scenario_says_how_quiet_the_machine_was(server_dsn: str) -> None:
    # the bulk load is the quickest scenario; the record is made for every scenario in the same place
    args = _parser().parse_args(["load", "--jobs", "50", "--repeat", "2", "--database-url", server_dsn,
                                 "--database-prefix", f"bench_smoke_{os.getpid()}"])
    machine, results, rounds = await _run(args)
    assert [(r.completed, r.runs) for r in results] == [(50, 50), (50, 50)]
    assert [r["round"] for r in machine["rounds"]] == [1, 2]  # in the JSON
    for record in rounds:
        assert len(record.load_before) == 3 and record.load_during_max is not None and record.seconds > 0
    report = _quietness(rounds)
    assert "round 1: load average" in report and "round 2: load average" in report
    assert ("WARNING: the machine was busy" in report) == any(r.busy for r in rounds)
    assert spread_table(results).startswith("  chimes jobs import, 2 rounds, min / median / max: drain s ")
