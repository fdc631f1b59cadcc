"""The worker's claim order across priority tiers."""

from __future__ import annotations

import pytest

from chimes.enums import Priority
from chimes.worker.tiers import ClaimStep, TierPolicy, claim_steps, owner_room

HIGH, NORMAL, BATCH = Priority.HIGH, Priority.NORMAL, Priority.BATCH

POLICY = TierPolicy(batch_share=0.8, every=5, low_share=0.1)


@pytest.mark.parametrize(("cycle", "free", "batch_room", "expected"), [
    # Usual cycle: high and normal first, then batch up to its room.
    (1, 20, 16, [ClaimStep(HIGH, NORMAL, 20), ClaimStep(BATCH, BATCH, 16)]),
    # Batch already fills its share of the worker: only high and normal are claimed.
    (2, 4, 0, [ClaimStep(HIGH, NORMAL, 4)]),
    # Every fifth cycle the lower tiers get a small first turn, so they never starve.
    (5, 20, 16, [ClaimStep(BATCH, BATCH, 2), ClaimStep(NORMAL, NORMAL, 2), ClaimStep(HIGH, NORMAL, 20),
                 ClaimStep(BATCH, BATCH, 16)]),
    # ...at least one run each, however few slots are free.
    (10, 3, 1, [ClaimStep(BATCH, BATCH, 1), ClaimStep(NORMAL, NORMAL, 1), ClaimStep(HIGH, NORMAL, 3),
                ClaimStep(BATCH, BATCH, 1)]),
])
def test_claim_steps(cycle: int, free: int, batch_room: int, expected: list[ClaimStep]) -> None:
    assert claim_steps(POLICY, cycle, free, batch_room) == expected


@pytest.mark.parametrize(("concurrency", "cap"), [(100, 80), (10, 8), (1, 1), (2, 1)])
def test_batch_leaves_room_for_higher_tiers(concurrency: int, cap: int) -> None:
    assert POLICY.batch_cap(concurrency) == cap


def test_an_owner_may_hold_at_most_its_share_of_a_worker() -> None:
    policy = TierPolicy()
    assert (policy.owner_cap(100), policy.owner_cap(10), policy.owner_cap(1)) == (80, 8, 1)
    assert TierPolicy(owner_share=1.0).owner_cap(100) == 100


@pytest.mark.parametrize(("running", "limit", "full", "at_most"), [
    ([], 100, [], 8),                                  # nobody runs: one owner may take its whole share
    (["a"] * 3, 100, [], 5),                           # a may take 5 more, and so may whoever comes next
    (["a"] * 8, 2, ["a"], 2),                          # a is at its share: the claim skips a's runs
    (["a"] * 8 + ["b"] * 7, 100, ["a"], 1),            # b has one slot of its share left
    (["b"] * 8 + ["a"] * 8, 100, ["a", "b"], 8),       # both full: only other owners are claimed
])
def test_a_claim_leaves_every_owner_within_its_share(running: list[str], limit: int, full: list[str],
                                                     at_most: int) -> None:
    room = owner_room(running, TierPolicy().owner_cap(10), limit)
    assert (room.full, room.at_most) == (full, at_most)


def test_an_owner_at_its_share_is_claimed_for_again_once_a_quarter_of_it_has_ended() -> None:
    room = owner_room(["a"] * 80 + ["b"] * 81 + ["c"] * 3, TierPolicy().owner_cap(100), 100)
    assert room.refill == {"a": 20, "b": 21}  # b is one past its share: one more run of it to end
    assert owner_room(["a"], TierPolicy().owner_cap(2), 2).refill == {"a": 1}  # a share of one slot
    assert owner_room(["a"] * 3, TierPolicy().owner_cap(10), 10).refill == {}
