"""The short chaos runs: a real fleet (its own PostgreSQL, 3 scheduler nodes, 3 workers, an API, an HTTP
target) broken on purpose for 90 seconds with a fixed seed, then every invariant checked.

Seed 2 over 90 s draws every kind of fault: SIGKILLed and SIGSTOPped scheduler nodes and workers,
PostgreSQL restarted fast and immediate, a target answering errors, hanging and dropping connections.
The long run (docs/reliability.md) is the same harness for 30 minutes. The sharded runs put the
partitions on two servers, the last one moving ranges of them between the two meanwhile.
"""

from __future__ import annotations

from collections import Counter

import pytest

from chimes_chaos.faults import WEIGHTS, plan_faults
from chimes_chaos.harness import ChaosOptions, run_chaos

pytestmark = pytest.mark.long  # a fleet broken on purpose for minutes

SEED = 2
DURATION = 90.0
FAULT_EVERY = 3.0


def test_the_seed_draws_every_kind_of_fault() -> None:
    planned = plan_faults(SEED, DURATION, schedulers=["scheduler-1", "scheduler-2", "scheduler-3"],
                          workers=["worker-1", "worker-2", "worker-3"], lease_ttl=3, worker_lease=5,
                          mean_gap=FAULT_EVERY, database=True)
    assert set(Counter(f.kind for f in planned)) == set(WEIGHTS)


@pytest.mark.timeout(300)
async def test_a_fleet_broken_for_90_seconds_keeps_every_invariant() -> None:
    report = await run_chaos(ChaosOptions(duration=DURATION, seed=SEED, jobs=30, fault_every=FAULT_EVERY))
    print(report.text())
    assert sum(report.faults.values()) >= 15, report.faults
    assert report.faults_skipped == 0, "a fault could not be injected (see the report's windows)"
    assert report.figures["slots_checked"] > 500
    assert report.runs.get("succeeded", 0) > 500
    assert report.figures["attempts_reaped"] > 0, "no worker fault caught a run in flight: the fences went untested"
    assert report.ok, report.text()


SHARDED_SEED = 4
SHARDED_DURATION = 45.0
SHARDED_FAULT_EVERY = 4.0


def test_the_sharded_seed_stops_a_shard() -> None:
    planned = plan_faults(SHARDED_SEED, SHARDED_DURATION, schedulers=["scheduler-1", "scheduler-2", "scheduler-3"],
                          workers=["worker-1", "worker-2", "worker-3"], lease_ttl=3, worker_lease=5,
                          mean_gap=SHARDED_FAULT_EVERY, database=True, shards=2)
    assert [f for f in planned if f.kind == "stop_postgres_shard" and f.duration > 3 + 5]


@pytest.mark.sharded_pass  # in the second pass, scripts/test --sharded
@pytest.mark.timeout(300)
async def test_a_sharded_fleet_keeps_every_invariant_and_one_stopped_shard_delays_only_its_own_runs() -> None:
    """Two servers (the catalog with partitions 0-511, a shard with 512-1023), one fleet over both;
    the shard's PostgreSQL is SIGSTOPped for 13.9 s (past the lease TTL and the run lease) among the
    other faults. The catalog's runs that waited meanwhile must start on time (invariant 11), the
    shard's catch up, and every other invariant hold over both databases."""
    report = await run_chaos(ChaosOptions(duration=SHARDED_DURATION, seed=SHARDED_SEED, jobs=20, shards=2,
                                          fault_every=SHARDED_FAULT_EVERY))
    print(report.text())
    assert report.faults.get("stop_postgres_shard") == 1 and report.faults_skipped == 0, report.fault_windows
    stops = report.figures["shard_stops"]
    healthy, stopped = stops["start_lag_other_homes_sec"], stops["start_lag_stopped_home_sec"]
    assert healthy["n"] >= 10, stops  # enough of the catalog's runs waited during the stop to judge
    assert healthy["p99"] <= 2.0, stops
    assert stopped["n"] > 0 and stopped["max"] > 5.0, stops  # the shard's own runs did wait for it
    runs_by_home = report.figures["runs_by_home"]
    assert min(runs_by_home.values()) > 100, runs_by_home  # both homes ran their share
    assert report.ok, report.text()


MOVES_DURATION = 40.0


@pytest.mark.sharded_pass  # in the second pass, scripts/test --sharded
@pytest.mark.timeout(300)
async def test_partition_ranges_moved_back_and_forth_under_faults_lose_nothing() -> None:
    """`--shards 2 --moves`: during 40 s of faults (a shard stop among them) the upper half of each home's
    range moves to the other home and back through `python -m chimes shards move`, some movers
    SIGKILLed and resumed or cancelled. Every row must end on the home the final map gives it, alone
    (invariant 12), and every other invariant hold when each row is read there."""
    report = await run_chaos(ChaosOptions(duration=MOVES_DURATION, seed=SHARDED_SEED, jobs=20, shards=2, moves=True,
                                          fault_every=SHARDED_FAULT_EVERY))
    print(report.text())
    moves = report.figures["moves"]
    assert moves["moves_done"] >= 1, moves
    assert moves["moves"] >= 3, moves  # one after another through the fault phase
    assert report.faults_skipped == 0, report.fault_windows
    assert report.figures["rows_placed"] > 300  # every job and run of the workload was looked for on every home
    assert all(w["ended"] is not None for w in report.move_windows), report.move_windows  # none left under way
    assert report.ok, report.text()
