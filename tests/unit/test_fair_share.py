"""Tests for chimes.store.scheduling.fair_share: how many partitions each node should lease."""

from __future__ import annotations

import itertools
import random

import pytest

from chimes.store.scheduling import fair_share


def shares(nodes: list[str], partitions: int = 1024) -> dict[str, int]:
    return {node: fair_share(nodes, node, partitions) for node in nodes}


@pytest.mark.parametrize("count", range(1, 8))
def test_shares_sum_to_all_partitions_and_are_even(count: int) -> None:
    nodes = [f"node-{i}" for i in range(count)]
    got = shares(nodes)
    assert sum(got.values()) == 1024
    assert max(got.values()) - min(got.values()) <= 1
    assert min(got.values()) == 1024 // count


def test_property_over_many_sizes_and_partition_counts() -> None:
    rng = random.Random(3)
    for count in range(1, 60):
        nodes = [f"n{rng.getrandbits(32):08x}-{i}" for i in range(count)]
        for partitions in (1, 7, 1024, 1025):
            got = shares(nodes, partitions)
            assert sum(got.values()) == partitions
            assert max(got.values()) - min(got.values()) <= 1


@pytest.mark.parametrize(
    ("live", "node", "expected"),
    [
        ([], "a", 1024),
        (["b"], "a", 512),  # the caller counts even when not yet in the live list
        (["a", "b", "c"], "d", 256),
        (["b", "c"], "a", 342),  # 1024 = 3 * 341 + 1: the remainder goes to the first (sorted) node
        (["a", "c"], "b", 341),
        (["a", "b", "b"], "a", 512),  # duplicates do not count twice
    ],
)
def test_table(live: list[str], node: str, expected: int) -> None:
    assert fair_share(live, node) == expected


def test_independent_of_list_order() -> None:
    nodes = ["delta", "alpha", "echo", "charlie", "bravo"]
    expected = shares(nodes)
    assert sorted(expected.values(), reverse=True) == [205, 205, 205, 205, 204]
    for perm in itertools.permutations(nodes):
        assert shares(list(perm)) == expected
