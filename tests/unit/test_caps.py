"""Admission of capped runs, in queue order, never past a cap."""

from __future__ import annotations

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
