"""The arithmetic of the high-availability benchmarks' reports (bench/ha_cost.py, bench/async_loss.py):
what counts as lost, over which window, and the cost per run by process group."""

from __future__ import annotations

from bench.api_client import Write
from bench.async_loss import LossRound, count_losses, loss_table, summarise
from bench.ha_cost import cost_rows, cost_table, cpu_ms_per_run
from bench.report import Result

KILL = 1000.0


def test_lost_jobs_are_acknowledged_ones_missing_with_the_window_from_the_first_to_the_kill() -> None:
    writes = [Write(990.0, 990.1, 201, "a"), Write(999.0, 999.4, 201, "b"), Write(999.5, 999.9, 201, "c"),
              Write(999.6, 1000.2, 201, "d"),  # answered just after the kill: the commit came before it
              Write(1000.1, 1015.0, 503, None), Write(1021.0, 1021.1, 201, "e")]
    round_ = count_losses(mode="async", kill_at=KILL, promoted_at=1020.5, writes=writes,
                          jobs_found={"a", "b", "e"}, deliveries=[], runs_found=set())
    assert (round_.acknowledged, round_.lost_jobs) == (5, 2)
    assert round_.lost_jobs_window_ms == 100.0  # c's 201 came 0.1 s before the kill, d's after it
    assert round_.ack_per_sec == 1.0  # b and c in the 2 s before the kill
    assert round_.outage_sec == 20.5


def test_lost_runs_are_deliveries_before_the_kill_missing_and_a_second_call_is_executed_twice() -> None:
    deliveries = [(998.0, "run-1", "/r1-once-1"), (999.7, "run-2", "/r1-once-2"), (999.8, "run-3", "/r1-once-3"),
                  (1030.0, "run-4", "/r1-once-3"),  # run-3's fire was lost: its trigger fired again
                  (1031.0, "run-5", "/r1-once-9")]
    round_ = count_losses(mode="async", kill_at=KILL, promoted_at=1020.0, writes=[], jobs_found=set(),
                          deliveries=deliveries, runs_found={"run-1", "run-4", "run-5"})
    assert (round_.delivered, round_.lost_runs, round_.executed_twice) == (3, 2, 1)
    assert round_.lost_runs_window_ms == 300.0
    assert (round_.lost_jobs, round_.lost_jobs_window_ms) == (0, None)


def test_summary_per_mode_and_the_table_say_what_each_lost() -> None:
    def loss(mode: str, lost: int, window: float | None) -> LossRound:
        return LossRound(mode, 20.0, 1000, 200.0, lost, window, 900, 0, None, 0)

    rounds = [loss("async", 3, 12.0), loss("async", 0, None), loss("sync", 0, None)]
    summary = summarise(rounds)
    assert (summary["async"]["lost_jobs"], summary["async"]["lost_jobs_per_failover"],
            summary["async"]["most_lost_jobs"], summary["async"]["widest_window_ms"]) == (3, 1.5, 3, 12.0)
    assert (summary["sync"]["failovers"], summary["sync"]["lost_jobs"], summary["sync"]["widest_window_ms"]) == (
        1, 0, None)
    text = loss_table(rounds)
    assert "asynchronous standby: 3 of 2,000 acknowledged jobs lost in 2 failovers" in text
    assert "synchronous standby: 0 of 1,000 acknowledged jobs lost in 1 failovers" in text


def test_cpu_per_run_groups_processes_and_names_the_single_server_primary() -> None:
    cpu = cpu_ms_per_run({"scheduler": 0.5, "worker1": 1.0, "worker2": 1.5, "postgresql": 2.0}, 1000)
    assert cpu == {"scheduler": 0.5, "workers": 2.5, "primary": 2.0}
    assert cpu_ms_per_run({"scheduler": 1.0}, 0) == {}


def test_cost_rows_compare_each_setup_with_one_postgresql() -> None:
    def result(system: str, drain: float, cpu: dict[str, float], create_p50: float, wal: int) -> Result:
        r = Result(system, "ha-cost", 1000, 1000, drain, start_lag={"p50": 1.0, "p95": 1.5, "p99": 2.0, "max": 2.1},
                   cpu_sec=cpu)
        r.extra = {"create_latency_ms": {"p50": create_p50, "p95": 0, "p99": 2 * create_p50, "max": 0},
                   "wal_bytes_per_run": wal}
        return r

    results = [result("one", 1.0, {"scheduler": 0.2, "worker": 0.4, "postgresql": 0.4}, 4.0, 2800),
               result("sync", 2.0, {"scheduler": 0.2, "worker": 0.4, "primary": 0.6, "standby": 0.3}, 6.0, 2800)]
    rows = cost_rows(results)
    assert rows[1]["cpu_ms_per_run"] == {"scheduler": 0.2, "workers": 0.4, "primary": 0.6, "standby": 0.3}
    assert rows[1]["vs_single"] == {"runs_per_sec": 0.5, "create_latency_p50": 1.5, "cpu_ms_per_run": 1.5,
                                    "wal_bytes_per_run": 1.0}
    assert "0.200, 0.400, 0.600, 0.300 = 1.500" in cost_table(results)
