"""The map arithmetic of a move: which home holds a range, and the shard ranges a cut-over writes."""

from __future__ import annotations

import pytest

from chimes.moves import MoveError, source_of
from chimes.store.moves import reassign
from chimes.store.shards import ShardMap, ShardRange


def shard(first: int, last: int, shard_id: int, since: int = 1) -> ShardRange:
    return ShardRange(first, last, shard_id, f"postgresql:///shard{shard_id}", since)


MAP = ShardMap(3, (shard(0, 255, 1), shard(512, 767, 2, since=2)))


def test_the_source_is_the_one_home_that_holds_the_whole_range() -> None:
    assert source_of(MAP, 0, 255) == 1
    assert source_of(MAP, 300, 400) is None  # the catalog
    assert source_of(MAP, 600, 610) == 2
    with pytest.raises(MoveError, match="live in several homes"):
        source_of(MAP, 200, 300)


def test_a_cut_over_splits_the_source_range_and_adds_the_target_range() -> None:
    replaced, pieces = reassign(MAP.ranges, 100, 199, 2, version=4)
    assert replaced == [MAP.ranges[0]]
    assert pieces == [(0, 99, 1, 1), (100, 199, 2, 4), (200, 255, 1, 1)]


def test_a_range_moved_to_the_catalog_leaves_no_row_of_its_own() -> None:
    replaced, pieces = reassign(MAP.ranges, 512, 767, None, version=4)
    assert replaced == [MAP.ranges[1]]
    assert pieces == []


def test_a_range_moved_out_of_the_catalog_replaces_nothing() -> None:
    replaced, pieces = reassign(MAP.ranges, 300, 400, 1, version=4)
    assert replaced == []
    assert pieces == [(300, 400, 1, 4)]
