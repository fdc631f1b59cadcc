"""The chaos fault schedule: replayed exactly by its seed, and never more than the fleet can survive."""

from __future__ import annotations

import itertools
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from chimes.cli.chaos import chaos
from chimes_chaos.faults import DATABASE_COOLDOWN_SEC, PRIMARY_MOVES, FaultWindow, PlannedFault, plan_faults
from chimes_chaos.fleet import Fleet, FleetShape, partition_ranges

SCHEDULERS = ["scheduler-1", "scheduler-2", "scheduler-3"]
WORKERS = ["worker-1", "worker-2", "worker-3"]


def plan(seed: int, duration: float = 1800, database: bool = True) -> list[PlannedFault]:
    return plan_faults(seed, duration, schedulers=SCHEDULERS, workers=WORKERS, lease_ttl=3, worker_lease=5,
                       mean_gap=4, database=database)


def test_the_same_seed_replays_the_same_faults_and_another_seed_does_not() -> None:
    assert plan(7) == plan(7)
    assert plan(7) != plan(8)


def test_a_long_run_injects_hundreds_of_faults_of_every_kind() -> None:
    faults = plan(7)
    kinds = Counter(f.kind for f in faults)
    assert len(faults) >= 200
    assert set(kinds) == {"kill_scheduler", "freeze_scheduler", "kill_worker", "freeze_worker", "restart_postgres_fast",
                          "restart_postgres_immediate", "target_errors", "target_hang", "target_close"}
    assert all(f.at + f.duration < 1800 for f in faults)


def test_one_scheduler_and_one_worker_are_always_left_alone() -> None:
    for seed in range(20):
        faults = plan(seed, duration=600)
        for role in (SCHEDULERS, WORKERS):
            hits = [f for f in faults if f.victim in role]
            for f in hits:
                at_once = {g.victim for g in hits if g.at <= f.at <= g.at + g.duration}
                assert len(at_once) < len(role), f"seed {seed}: {at_once} down at {f.at}"


def test_freezes_outlast_the_leases_so_the_node_wakes_up_stale() -> None:
    faults = plan(7)
    assert all(f.duration > 3 for f in faults if f.kind == "freeze_scheduler")
    assert all(f.duration > 5 for f in faults if f.kind == "freeze_worker")


def test_database_restarts_only_on_the_harness_own_database_and_well_apart() -> None:
    assert not [f for f in plan(7, database=False) if "postgres" in f.kind]
    restarts = [f.at for f in plan(7) if "postgres" in f.kind]
    assert all(later - earlier >= DATABASE_COOLDOWN_SEC for earlier, later in itertools.pairwise(restarts))


def test_crashes_of_postgresql_itself_are_read_from_its_log(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, FleetShape())
    assert fleet.postgres is not None
    fleet.postgres.pgdata.mkdir(parents=True)
    (fleet.postgres.pgdata / "server.log").write_text(
        "2026-11-30 01:38:18.101 UTC [2211] LOG:  database system is ready to accept connections\n"
        "2026-11-30 01:38:41.879 UTC [2211] LOG:  client backend (PID 2253) was terminated by signal 11: "
        "Segmentation fault\n"
        "2026-11-30 01:38:42.814 UTC [2312] LOG:  database system was not properly shut down\n"
        "2026-11-30 01:38:42.950 UTC [2211] LOG:  database system is ready to accept connections\n")
    [(start, end, line)] = fleet.database_crashes()
    assert (start, end) == (datetime(2026, 11, 30, 1, 38, 41, 879000, UTC).timestamp(),
                            datetime(2026, 11, 30, 1, 38, 42, 950000, UTC).timestamp())
    assert "signal 11" in line
    assert Fleet(tmp_path, FleetShape(), database_url="postgresql://elsewhere/db").database_crashes() == []


def test_with_ha_the_primary_is_killed_frozen_and_moved_instead_of_restarted() -> None:
    faults = plan_faults(7, 1800, schedulers=SCHEDULERS, workers=WORKERS, lease_ttl=3, worker_lease=5, mean_gap=4,
                         database=False, ha=True)
    database = [f for f in faults if "postgres" in f.kind]
    assert {f.kind for f in database} == {"kill_postgres_primary", "switchover_postgres", "freeze_postgres_primary",
                                          "kill_postgres_etcd"}
    failovers = [f for f in database if f.kind != "kill_postgres_etcd"]
    assert len(failovers) >= 20  # a 30-minute run moves the primary at least 20 times
    # A killed primary stays down past Patroni's TTL (20 s), so its standby is promoted, and comes back after.
    assert all(f.duration > 20 for f in database if f.kind in ("kill_postgres_primary", "freeze_postgres_primary"))
    # One database fault at a time, each over (and settled) before the next.
    for earlier, later in itertools.pairwise(database):
        assert later.at >= earlier.at + earlier.duration + DATABASE_COOLDOWN_SEC


def test_with_zones_a_long_run_cuts_zones_and_still_moves_the_primary_twenty_times() -> None:
    faults = plan_faults(7, 1800, schedulers=SCHEDULERS, workers=WORKERS, lease_ttl=3, worker_lease=5, mean_gap=4,
                         database=False, ha=True, zones=True)
    kinds = Counter(f.kind for f in faults)
    assert kinds["cut_primary_zone"] + kinds["cut_other_zone"] >= 5, kinds
    assert sum(kinds[k] for k in PRIMARY_MOVES) >= 20, kinds
    # A cut outlasts Patroni's TTL (20 s) and the lease TTL, so the primary and the partitions move.
    cuts = [f for f in faults if "zone" in f.kind]
    assert all(20 < f.duration < 40 for f in cuts)
    # Cuts never overlap a database fault: each is survivable alone.
    shared = [f for f in faults if "postgres" in f.kind or "zone" in f.kind]
    for earlier, later in itertools.pairwise(shared):
        assert later.at >= earlier.at + earlier.duration + DATABASE_COOLDOWN_SEC
    assert FaultWindow("cut_other_zone", "zone-3", 0.0).hits == "zone"


def test_shard_stops_only_with_shards_outlast_both_leases_and_never_overlap_another_database_fault() -> None:
    assert "stop_postgres_shard" not in {f.kind for f in plan(7)}  # one database: today's plan, unchanged
    faults = plan_faults(7, 1800, schedulers=SCHEDULERS, workers=WORKERS, lease_ttl=3, worker_lease=5, mean_gap=4,
                         database=True, shards=3)
    stops = [f for f in faults if f.kind == "stop_postgres_shard"]
    assert len(stops) >= 10
    assert all(3 + 5 < f.duration < 3 + 5 + 8 for f in stops)
    database = [f for f in faults if "postgres" in f.kind]
    for earlier, later in itertools.pairwise(database):
        assert later.at >= earlier.at + earlier.duration + DATABASE_COOLDOWN_SEC


def test_a_sharded_fleet_splits_the_partitions_evenly_the_catalog_first(tmp_path: Path) -> None:
    assert partition_ranges(1) == [(0, 1023)]
    assert partition_ranges(3) == [(0, 340), (341, 681), (682, 1023)]
    fleet = Fleet(tmp_path, FleetShape(), shards=3)
    homes = fleet.home_of_partitions()
    assert (homes[0], homes[340], homes[341], homes[1023]) == (0, 0, 1, 2)
    assert fleet.home_names == ["catalog", "shard-1", "shard-2"] and len(fleet.shard_servers) == 2


def test_shards_are_refused_with_a_database_of_someone_else(tmp_path: Path) -> None:
    for kwargs in ({"database_url": "postgresql://db/x"}, {"ha": True}):
        with pytest.raises(ValueError, match="cannot be combined"):
            Fleet(tmp_path, FleetShape(), shards=2, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("args", "named"), [(["--zones"], "--zones"), (["--ha"], "--ha"),
                                             (["--database-url", "postgresql://db/x"], "--database-url")])
def test_chimes_chaos_refuses_shards_with_a_database_of_someone_else(args: list[str], named: str) -> None:
    result = CliRunner().invoke(chaos, ["--shards", "2", *args], env={"CHIMES_DATABASE_URL": None})
    assert result.exit_code == 2 and f"cannot be combined with {named}" in result.output, result.output


@pytest.mark.parametrize("shards", [[], ["--shards", "1"]])
def test_chimes_chaos_refuses_moves_with_one_database(shards: list[str]) -> None:
    result = CliRunner().invoke(chaos, ["--moves", *shards], env={"CHIMES_DATABASE_URL": None})
    assert result.exit_code == 2 and "--moves moves partitions between homes: it needs --shards 2" in result.output, (
        result.output)
