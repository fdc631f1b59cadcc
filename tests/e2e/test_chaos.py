"""The short chaos run: a real fleet (its own PostgreSQL, 3 scheduler nodes, 3 workers, an API, an HTTP
target) broken on purpose for 90 seconds with a fixed seed, then every invariant checked.

Seed 2 over 90 s draws every kind of fault: SIGKILLed and SIGSTOPped scheduler nodes and workers,
PostgreSQL restarted fast and immediate, a target answering errors, hanging and dropping connections.
The long run (docs/reliability.md) is the same harness for 30 minutes.
"""

from __future__ import annotations

from collections import Counter

import pytest

from chimes_chaos.faults import WEIGHTS, plan_faults
from chimes_chaos.harness import ChaosOptions, run_chaos

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
