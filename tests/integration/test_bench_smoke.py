"""The benchmark code keeps working: the burst, top-of-hour, idle-wal, shards, move, http-calls,
claim-plan, fleet-model and peers scenarios, tiny, on the test server (shards and move: on servers of
their own).

Real `chimes scheduler` and `chimes worker` processes and the benchmark's own HTTP target, as in a
real benchmark run; no timing is asserted (the machine is shared), only that every run is accounted
for and the report can be written.

The peers of `python -m bench peers` (PgQueuer, procrastinate, Celery) come with the `bench` extra,
and Celery with a redis-server, which a test install (the `test` extra) lacks: `peers` with Chimes
alone runs in every pass; with the peers this machine has, in the second pass.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson
import pytest

from bench.__main__ import _parser, _quietness, _run
from bench.chimes_runs import FleetShape, end_to_end
from bench.claim_plan import MEASURED, claim_plan, plan_table
from bench.env import Env
from bench.fleet_model import fleet_model, model_table
from bench.http_calls import CLIENTS, WARM_UP, http_calls
from bench.idle_wal import idle_wal, wal_table
from bench.peer_report import combined, round_order, sitting_table
from bench.peer_setup import NEEDS, look
from bench.report import Result, spread_table, table
from bench.shards import cpu_ms_per_run, shards, shards_table
from bench.target import TargetProcess
from bench.top_of_hour import top_of_hour
from chimes.cli.roles import SCHEDULER_POOL, WORKER_POOL

# long: each benchmark scenario run small; quiet_server: the scenarios measure the server's WAL
pytestmark = [pytest.mark.long, pytest.mark.usefixtures("quiet_server")]


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
    assert result.extra["first_call_sec"] >= 0  # no call before its time
    assert set(result.peak_mb) == {"scheduler", "worker"} and all(mb > 0 for mb in result.peak_mb.values())
    assert "30/30" in table([result])
    # the WAL a run wrote, by relation and record (pg_walinspect): the run rows among them
    assert any(r["relation"].startswith("runs") and r["records"] > 0 for r in result.extra["wal_by_record_per_run"])
    assert orjson.loads(orjson.dumps(result.to_json()))["runs"] == 30


async def test_fleet_model_scenario_measures_the_costs_then_checks_a_larger_fleet(server_dsn: str,
                                                                                 tmp_path: Path) -> None:
    env = Env(server_dsn, tmp_path, None, prefix=f"bench_smoke_{os.getpid()}")
    target = TargetProcess(tmp_path)
    settled = []

    async def settle() -> None:
        settled.append(True)

    try:
        results = await fleet_model(env, target, runs=30, check_workers=[2], concurrency=10, rate=50_000,
                                    say=lambda _: None, settle=settle)
    finally:
        target.stop()
    assert [(r.extra["part"], r.extra["fleet"]["workers"]) for r in results] == [("costs", 1), ("check", 2)]
    assert [(r.runs, r.completed, r.extra["distinct_calls"]) for r in results] == [(30, 30, 30)] * 2
    assert settled == [True]  # before the check's burst, not before the first
    costs, check = results
    # the target's CPU is apart from the fleet's, and every process's is counted from the due instant too
    assert set(costs.cpu_sec) == {"scheduler", "worker"} and costs.extra["target_cpu_sec"] >= 0
    assert set(costs.extra["cpu_sec_from_due"]) == {"scheduler", "worker", "target"}
    assert set(check.extra["cpu_sec_from_due"]) == {"scheduler", "worker1", "worker2", "target"}
    assert all(costs.extra["cpu_sec_from_due"][name] <= costs.cpu_sec[name] for name in costs.cpu_sec)
    text = model_table(results)
    assert "The fleet for 50,000 runs a second" in text and "PostgreSQL not read (an external server)" in text
    assert any(line.split()[:1] == ["2"] for line in text.splitlines())  # the check's row


async def test_claim_plan_scenario_reads_no_job_for_the_caps_while_there_are_none(server_dsn: str,
                                                                                   tmp_path: Path) -> None:
    env = Env(server_dsn, tmp_path, None, prefix=f"bench_smoke_{os.getpid()}")
    without, with_caps = [await claim_plan(env, runs=300, caps=caps, say=lambda _: None) for caps in (0, 2)]
    for result in (without, with_caps):
        assert len(result.extra["execution_ms"]) == len(result.extra["buffer_reads"]) == MEASURED
        assert all(ms > 0 for ms in result.extra["execution_ms"])
    # with a cap each of the 100 runs' jobs is looked up for it; with none, not one
    assert max(without.extra["buffer_reads"]) + 100 <= min(with_caps.extra["buffer_reads"])
    assert "    300 |    0 |" in plan_table([without, with_caps])


@pytest.mark.parametrize("distinct_urls", [False, True])
async def test_http_calls_scenario_makes_every_call_through_each_client(tmp_path: Path, distinct_urls: bool) -> None:
    target = TargetProcess(tmp_path)
    try:
        results = await http_calls(target.url, runs=50, concurrency=5, say=lambda _: None, distinct_urls=distinct_urls)
        deliveries = await target.deliveries()
    finally:
        target.stop()
    assert [r.system for r in results] == list(CLIENTS.values())
    assert [(r.runs, r.completed) for r in results] == [(50, 50)] * len(CLIENTS)
    assert len(deliveries) == len(CLIENTS) * (50 + WARM_UP), "each client's calls and its warm-up's reached the target"
    paths = sorted({path for _, _, path in deliveries})
    # with distinct URLs each call of a client, warm-up included, had a path of its own
    assert paths == (sorted(f"/r{i}" for i in range(50 + WARM_UP)) if distinct_urls else ["/r"])
    assert all(r.cpu_sec["client"] > 0 and r.extra["cpu_us_per_call"] > 0 for r in results)
    assert "50/50" in table(results)


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
    # and what each process spent meanwhile
    assert {"scheduler", "worker"} <= set(result.extra["cpu_sec_per_sec"])
    assert "CPU seconds a second" in wal_table(result)


async def test_every_round_of_a_repeated_scenario_says_how_quiet_the_machine_was(server_dsn: str) -> None:
    # the bulk load is the quickest scenario; the record is made for every scenario in the same place
    # --settle 0: the suite keeps the machine busy, so rounds start at once (bench/quiet.py's settle
    # has unit tests of its own)
    args = _parser().parse_args(["load", "--jobs", "50", "--repeat", "2", "--database-url", server_dsn,
                                 "--database-prefix", f"bench_smoke_{os.getpid()}", "--settle", "0"])
    machine, results, rounds = await _run(args)
    assert [(r.completed, r.runs) for r in results] == [(50, 50), (50, 50)]
    assert [r["round"] for r in machine["rounds"]] == [1, 2]  # in the JSON
    for record in rounds:
        assert len(record.load_before) == 3 and record.load_during_max is not None and record.seconds > 0
    report = _quietness(rounds)
    assert "round 1: load average" in report and "round 2: load average" in report
    assert ("WARNING: the machine was busy" in report) == any(r.busy for r in rounds)
    assert spread_table(results).startswith("  chimes jobs import, 2 rounds, min / median / max: drain s ")


@pytest.mark.sharded_pass  # about shards: in the second pass, scripts/test --sharded
async def test_shards_scenario_reports_each_configuration_the_api_and_a_stopped_shard() -> None:
    # Its own embedded servers (one per shard, over TCP), not the session's: the scenario starts them,
    # in a folder the servers' system user can reach (not pytest's tmp_path, which is private to root).
    workdir = Path(tempfile.mkdtemp(prefix="chimes-bench-shards-"))
    env = Env("postgresql://unused", workdir, None, prefix=f"bench_smoke_{os.getpid()}")
    target = TargetProcess(workdir)
    try:
        results = await shards(env, target, runs=60, counts=[1, 2], creates=5, shape=FleetShape(concurrency=10),
                               say=lambda _: None)
    finally:
        target.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    one, two, stalled = (r for r in results if r.scenario == "shards")
    assert [one.system, two.system, stalled.system] == ["1 shard", "2 shards", "2 shards, pg2 stopped"]
    for burst in (one, two, stalled):
        assert (burst.runs, burst.completed, burst.extra["calls"], burst.extra["distinct_calls"]) == (60, 60, 60, 60)
        assert sum(s["runs"] for s in burst.extra["by_server"]) == 60
        assert burst.extra["wal_bytes_per_run"] > 0
    # each server holds its half of the partitions, and its runs and WAL are its own
    assert [(s["server"], s["partitions"]) for s in two.extra["by_server"]] == [("pg1", "0-511"), ("pg2", "512-1023")]
    assert all(s["runs"] > 0 and s["wal_bytes_per_run"] > 0 for s in two.extra["by_server"])
    cpu = cpu_ms_per_run(two)
    assert {"scheduler", "workers", "pg1", "pg2", "postgresql"} <= set(cpu) and cpu["postgresql"] > 0
    # every role holds connections on every server, the scheduler within (shards + 1) x its pool; a
    # worker's LISTEN and claims connections per home are outside its pool
    held = two.extra["connections"]["by_process"]
    assert set(held["scheduler"]["by_server"]) == set(held["worker"]["by_server"]) == {"pg1", "pg2"}
    assert 2 <= held["scheduler"]["most_at_once"] <= held["scheduler"]["bound"] == 2 * SCHEDULER_POOL
    assert 2 <= held["worker"]["most_at_once"] <= held["worker"]["bound"] == 2 * (WORKER_POOL + 2)
    assert set(one.extra["connections"]["by_process"]["scheduler"]["by_server"]) == {"pg1"}
    # the API's routing, with 1 shard and with 2: every create and read answered, the jobs in both homes
    api_one, api_two = (r for r in results if r.scenario == "shards-api")
    assert [api_one.system, api_two.system] == ["API, 1 shard", "API, 2 shards"]
    assert api_one.extra["create"]["requests"] == api_two.extra["get"]["requests"] == 5
    assert api_one.extra["jobs_by_server"] == [30] and sum(api_two.extra["jobs_by_server"]) == 30  # 20 + 2 x 5
    assert min(api_two.extra["jobs_by_server"]) > 0
    # the blast radius: pg2 stopped at the due second, pg1's runs against pg1's with nothing stopped
    blast = stalled.extra["blast_radius"]
    assert blast["stopped"]["server"] == "pg2" and blast["stopped"]["seconds"] > 0
    assert blast["healthy_start_lag_one_stopped"] is not None and blast["healthy_start_lag_nothing_stopped"]
    report = shards_table(results)
    assert "2 shards, pg2 stopped" in report and "blast radius, 2 shards, pg2 stopped" in report
    assert "GET /jobs/{id}" in report and "scheduler: pg1 " in report
    assert orjson.loads(orjson.dumps([r.to_json() for r in results], default=str))[0]["extra"]["shards"] == 1


@pytest.mark.sharded_pass  # about shards: in the second pass, scripts/test --sharded
def test_move_scenario_moves_half_the_partitions_with_every_slot_called_and_reports(tmp_path: Path) -> None:
    # `python -m bench move` as it is run: its own two embedded servers, fleet, API and mover processes
    report = tmp_path / "move.json"
    finished = subprocess.run([sys.executable, "-m", "bench", "move", "--schedules", "2000", "--settle", "0",
                               "--duration", "2", "--json", str(report)], capture_output=True, text=True, timeout=150)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    figures = orjson.loads(report.read_bytes())
    (result,) = figures["results"]
    moved = result["extra"]
    # every job of 512-1023 went to the second server, none stayed behind, and each was copied
    assert moved["jobs_in_range"] > 800 and moved["jobs_on_target_after"] == moved["jobs_in_range"]
    assert moved["jobs_in_range_left_on_source"] == 0
    assert moved["rows_copied"] >= moved["jobs_in_range"] and moved["copy_rate_rows_per_sec"] > 0
    assert moved["shard_moves"]["phase"] == "done" and moved["passes"] >= 2
    assert moved["move_wall_sec"] > 0 and set(moved["phases_sec"]) == {"copying", "fenced", "cleaning"}
    assert all(seconds >= 0 for seconds in moved["phases_sec"].values())
    assert any(m["line"].startswith("move 1: partitions 512-1023 catalog -> shard 1, done")
               for m in moved["mover_lines"])
    # every slot of the every-second jobs was called, once, before, during and after the move
    slots = moved["every_second_jobs"]
    assert slots["slots"] >= 6 * 5 and (slots["missing"], slots["called_twice"]) == (0, 0), slots
    assert result["completed"] == result["runs"] == slots["slots"]
    for side in ("moving_jobs", "staying_jobs"):
        assert moved["fire_delay_before_the_move"][side]["calls"] > 0
        assert moved["fire_delay_from_the_move_on"][side]["calls"] > 0
        assert moved["fire_delay_around_the_cut_over"][side]["calls"] > 0
    assert moved["longest_fire_delay_sec"] > 0 and moved["longest_gap_sec"] > 0.5
    # the API answered every write to the moving job, through the fence and after the cut-over
    for when in ("before_the_move", "during_the_move", "after_the_move"):
        assert set(moved["api_patch"][when]["statuses"]) == {"200"}, moved["api_patch"]
    assert moved["api_pause_ms"] == moved["api_patch"]["during_the_move"]["latency_ms"]["max"] > 0
    # how quiet the machine was, as for every scenario
    (round_record,) = figures["machine"]["rounds"]
    assert round_record["probe_ms"] > 0 and len(round_record["load_before"]) == 3
    assert "missing 0, called twice 0" in finished.stdout and "PATCH /jobs/{id} of a moving job" in finished.stdout


async def test_the_target_holds_each_call_and_counts_the_most_it_held_at_once(tmp_path: Path) -> None:
    target = TargetProcess(tmp_path)
    try:
        await target.reset(hold_ms=300)
        async with httpx.AsyncClient(timeout=30) as client:
            started = time.monotonic()
            answers = await asyncio.gather(*(client.post(f"{target.url}/call", headers={"X-Chimes-Run-Id": f"r{i}"})
                                             for i in range(6)))
            held = time.monotonic() - started
            assert [a.status_code for a in answers] == [200] * 6 and held >= 0.3  # answered once held
            assert await target.most_in_flight() == 6
            await target.reset()  # no hold from now on, and the count starts again
            for i in range(3):
                answer = await client.post(f"{target.url}/call", headers={"X-Chimes-Run-Id": f"s{i}"})
                assert answer.status_code == 200
            assert await target.most_in_flight() == 1
            _, keys = await target.arrivals()
            assert keys == ["s0", "s1", "s2"]
            refused = await client.post(f"{target.url}/_reset", params={"hold_ms": "-1"})
            assert refused.status_code == 400 and "hold_ms" in refused.text
    finally:
        target.stop()


def _peers_args(server_dsn: str, systems: str, *more: str) -> list[str]:
    return ["peers", "--systems", systems, "--runs", "24", "--in-flight", "4", "--hold-ms", "40", "--settle", "0",
            "--database-url", server_dsn, "--database-prefix", f"bench_smoke_{os.getpid()}", *more]


def _check_peer_results(results: list[Result], systems: list[str], rounds: int) -> None:
    expected = [(n + 1, variant, system) for n in range(rounds) for variant in ("noop", "http")
                for system in round_order(systems, n)]
    assert [(r.extra["round"], r.extra["variant"], r.extra["system_key"]) for r in results] == expected
    for r in results:
        assert (r.runs, r.completed) == (24, 24), r.system
        assert r.drain_sec is not None and r.drain_sec > 0
        assert r.extra["in_flight"]["stated"] == 4 and r.extra["worker_processes"] == 1
        if r.extra["variant"] == "noop":  # nothing called: the no-op is the queue's own cost
            assert r.extra["calls"] == 0 and r.extra["in_flight"]["most_at_target"] is None
        else:  # every run called the target once, and never more than the runs in flight at once
            assert r.extra["calls"] == 24 and r.start_lag is not None
            assert 1 <= r.extra["in_flight"]["most_at_target"] <= 4, r.system
        assert r.cpu_sec and all(seconds >= 0 for seconds in r.cpu_sec.values())
        assert r.extra["machine"]["load_before"]


async def test_peers_scenario_runs_chimes_through_both_variants_to_the_shared_finish_line(server_dsn: str) -> None:
    _, results, _ = await _run(_parser().parse_args(_peers_args(server_dsn, "chimes")))
    _check_peer_results(results, ["chimes"], 1)
    noop, http = results
    # at its defaults: the worker's slots set so that one owner's share (0.8) is the runs in flight
    assert noop.extra["settings"]["worker_concurrency"] == http.extra["settings"]["worker_concurrency"] == 5
    assert http.extra["settings"]["owner_share"].startswith("0.8 (the default)")
    assert noop.extra["settings"]["warnings"] == {}
    report = sitting_table(results)
    assert "noop: no-op task" in report and "http: HTTP task" in report
    assert "the target holding each call 40 ms" in report
    assert "none: no round measured Chimes and a peer both" in report


def _installed_peers() -> list[str]:
    machine = look()
    return [peer for peer, needs in NEEDS.items()
            if set(needs.check) <= machine.installed and (machine.redis_server or not needs.redis_server)]


@pytest.mark.sharded_pass  # minutes: every peer's processes, twice each
@pytest.mark.timeout(600)
async def test_peers_scenario_runs_every_installed_peer_like_chimes_and_pairs_them(server_dsn: str,
                                                                                   tmp_path: Path) -> None:
    peers = _installed_peers()
    missing = sorted(set(NEEDS) - set(peers))
    assert not missing, (f"peers not installed: {missing}: pip install -e '.[bench]' and apt-get install "
                         "redis-server (scripts/test --sharded does both)")
    systems = ["chimes", *peers]
    report = tmp_path / "peers.json"
    machine, results, _ = await _run(_parser().parse_args(_peers_args(server_dsn, ",".join(systems))))
    _check_peer_results(results, systems, 1)
    by_key = {(r.extra["system_key"], r.extra["variant"]): r for r in results}
    if "procrastinate" in peers:  # its concurrency is the runs in flight it is given
        assert by_key["procrastinate", "http"].extra["settings"]["per_process"]["concurrency"] == 4
    if "pgqueuer" in peers:
        assert by_key["pgqueuer", "http"].extra["settings"]["per_process"]["max_concurrent_tasks"] == [4]
    if "celery" in peers:
        assert by_key["celery", "http"].extra["settings"]["eta"] is False
    text = sitting_table(results)
    for peer in peers:
        assert f"http: {by_key[peer, 'http'].system}'s drain over Chimes': " in text
    # the sitting as its JSON holds it, read back as `python -m bench.peer_report` reads it
    report.write_bytes(orjson.dumps({"scenario": "peers", "command": "python -m bench peers", "machine": machine,
                                     "results": [r.to_json() for r in results]}, default=str))
    text = combined([report])
    assert f"{report}: python -m bench peers; " in text
    assert sum(line.startswith("  noop: ") or line.startswith("  http: ") for line in text.splitlines()) == \
        2 * len(peers)
