"""Admission of capped runs, in queue order, never past a cap."""

from __future__ import annotations

import click
import pytest

from chimes.cli.caps import cap_owner
from chimes.worker.caps import Candidate, admit


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
