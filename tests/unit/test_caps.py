"""Admission of capped runs, in queue order, never past a cap."""

from __future__ import annotations

import click
import pytest

from chimes.cli.caps import cap_owner
from chimes.store.cap_slots import full_caps
from chimes.store.queries import sql
from chimes.store.working import _caps_given
from chimes.worker.caps import Candidate, admit, caps_of


def test_admits_in_order_up_to_each_cap_without_blocking_others() -> None:
    queue = [Candidate(1, "a", ["db"]), Candidate(2, "a", ["db"]), Candidate(3, "b", []),
             Candidate(4, "a", ["db"]), Candidate(5, "b", ["db"]), Candidate(6, "c", ["web"])]
    rooms = {("tag", "db"): 2, ("owner", "b"): 1}
    assert admit(queue, rooms, limit=10) == [1, 2, 3, 6]


def test_a_run_under_two_caps_needs_room_in_both() -> None:
    queue = [Candidate(1, "a", ["db", "big"]), Candidate(2, "a", ["big"])]
    assert admit(queue, {("tag", "db"): 0, ("tag", "big"): 1}, limit=10) == [2]
    assert admit(queue, {("tag", "db"): 1, ("tag", "big"): 1}, limit=10) == [1]


def test_limit_and_zero_caps() -> None:
    queue = [Candidate(i, "a", []) for i in range(5)]
    assert admit(queue, {("owner", "a"): 3}, limit=2) == [0, 1]
    assert admit(queue, {("owner", "a"): 0}, limit=5) == []


def test_a_tag_cap_of_one_owner_counts_only_that_owners_jobs() -> None:
    queue = [Candidate(1, "b", ["reports"]), Candidate(2, "b", ["reports"]), Candidate(3, "a", ["reports"]),
             Candidate(4, "a", ["reports"])]
    assert admit(queue, {("tag", "reports", "a"): 1}, limit=10) == [1, 2, 3]
    assert admit(queue, {("tag", "reports"): 1}, limit=10) == [1], "fleet-wide: every owner's jobs share it"
    assert admit(queue, {("tag", "reports", "a"): 1, ("tag", "reports", "b"): 0}, limit=10) == [3]


def test_a_tag_cap_names_its_owner_or_is_fleet_wide_explicitly() -> None:
    assert cap_owner("tag", "team-a", False) == "team-a"
    assert cap_owner("tag", None, True) == ""
    assert cap_owner("owner", None, False) == ""
    for owner, fleet_wide in ((None, False), ("team-a", True)):
        with pytest.raises(click.UsageError, match=r"--owner TEAM .* or --fleet-wide"):
            cap_owner("tag", owner, fleet_wide)
    with pytest.raises(click.UsageError, match="for tag caps"):
        cap_owner("owner", "team-a", False)


def test_the_full_caps_filter_each_kind_of_cap() -> None:
    rooms = {("owner", "a"): 0, ("owner", "b"): 1, ("tag", "db"): 0, ("tag", "web", "c"): 0, ("tag", "x", "d"): 2}
    assert full_caps(rooms) == (["a"], ["db"], ["c"], ["web"])


@pytest.mark.parametrize(("name", "first"), [("claim_runs", 9), ("capped_candidates", 8)])
def test_a_shards_claim_reads_the_catalogs_caps_from_its_parameters(name: str, first: int) -> None:
    """The same statement as with one database, its table of caps swapped for the parameters after
    its own (a shard's own table is empty), and nothing else changed. claim_runs' own end with $8,
    the owners holding their share of the worker."""
    params = f"unnest(${first}::text[], ${first + 1}::text[], ${first + 2}::text[])"
    given = _caps_given(name, first)
    assert "concurrency_caps" not in given and given.count(params) == 1
    assert given.replace(f"{params} AS cap(scope, name, owner)", "concurrency_caps cap") == sql(name)
    assert f"${first}" not in sql(name) and f"${first + 3}" not in sql(name)


def test_a_slot_per_cap_a_run_falls_under() -> None:
    rooms = {("owner", "a"): 1, ("tag", "db"): 1, ("tag", "web", "a"): 1, ("tag", "web", "b"): 1}
    assert caps_of(Candidate(1, "a", ["db", "web"]), rooms) == [("owner", "a"), ("tag", "db"), ("tag", "web", "a")]
