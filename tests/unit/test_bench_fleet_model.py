"""The fleet model's arithmetic (bench.fleet_model): costs from CPU seconds, the fleet for a rate, a
fleet's shortest drain on a machine, and how --check-workers is read."""

from __future__ import annotations

import pytest

from bench.__main__ import _parser
from bench.fleet_model import RunCosts, cpu_bound, fleet_for, predicted_drain, run_costs


def test_costs_add_up_every_worker_and_leave_an_unread_database_unknown() -> None:
    costs = run_costs({"scheduler": 0.3, "worker1": 0.5, "worker2": 0.7, "postgresql": 0.8, "target": 0.1}, 10_000)
    assert (costs.scheduler, costs.worker, costs.database, costs.target) == (
        pytest.approx(0.00003), pytest.approx(0.00012), pytest.approx(0.00008), pytest.approx(0.00001))
    assert costs.machine == pytest.approx(0.00024)
    external = run_costs({"scheduler": 0.3, "worker": 1.0}, 10_000)
    assert external.database is None and external.target == 0.0
    assert external.machine == pytest.approx(0.00013)


def test_the_fleet_for_a_rate_is_a_core_per_process_rounded_up() -> None:
    costs = RunCosts(scheduler=0.00003, worker=0.0001, database=0.00007, target=0.0)
    bare = fleet_for(costs, 50_000)
    assert (bare.nodes, bare.workers) == (2, 5)  # 1.5 nodes' CPU takes two; 5.0 workers' exactly five
    assert bare.database_cores == pytest.approx(3.5)
    sized = fleet_for(costs, 50_000, 1.5)
    assert (sized.nodes, sized.workers) == (3, 8) and sized.database_cores == pytest.approx(5.25)
    assert fleet_for(RunCosts(0.00003, 0.0001, None, 0.0), 50_000).database_cores is None
    assert fleet_for(costs, 1).nodes == fleet_for(costs, 1).workers == 1  # at least one of each


def test_a_drain_is_set_by_one_worker_s_core_or_by_the_machine_s() -> None:
    costs = RunCosts(scheduler=0.0, worker=0.0001, database=0.00008, target=0.00002)
    # one worker on 16 cores: its own core bounds it (1 s for 10,000 runs)
    assert predicted_drain(costs, 10_000, 1, 16) == (pytest.approx(1.0), "a worker's core")
    # two on 2 cores: the machine's CPU, 2 s for all of them, over 2 cores
    assert predicted_drain(costs, 10_000, 2, 2) == (pytest.approx(1.0), "the machine's cores")
    assert predicted_drain(costs, 10_000, 4, 2)[1] == "the machine's cores"
    assert predicted_drain(costs, 10_000, 4, 16) == (pytest.approx(0.25), "a worker's core")


def test_a_burst_s_own_cpu_bounds_its_drain_by_its_busiest_process_or_the_machine() -> None:
    # two workers, one busier: its 1.2 s is longer than the 3.0 s of everything over 4 cores; the
    # database's 1.3 s is not one process's
    cpu = {"scheduler": 0.1, "worker1": 1.2, "worker2": 0.8, "postgresql": 1.3, "target": 0.2}
    assert cpu_bound(cpu, 4) == (pytest.approx(1.2), "the worker1's core")
    assert cpu_bound(cpu, 2) == (pytest.approx(1.8), "the machine's cores")
    assert cpu_bound({"up": 2.0, "primary": 2.5}, 4, servers=("primary",)) == (pytest.approx(2.0), "the up's core")


def test_check_workers_is_read_and_bad_lists_refused() -> None:
    assert _parser().parse_args(["fleet-model"]).check_workers == [1, 2]
    assert _parser().parse_args(["fleet-model", "--check-workers", "1,4,8"]).check_workers == [1, 4, 8]
    for bad in ("", "0", "a,2", "2,-1"):
        with pytest.raises(SystemExit):
            _parser().parse_args(["fleet-model", "--check-workers", bad])
