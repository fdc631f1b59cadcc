"""The shards benchmark's configurations: how --shards is read and how the partitions are split."""

from __future__ import annotations

import itertools

import pytest

from bench.__main__ import _parser
from bench.shards import even_ranges, parse_counts


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7, 16])
def test_even_ranges_cover_every_partition_once_in_order(count: int) -> None:
    ranges = even_ranges(count)
    assert len(ranges) == count and ranges[0][0] == 0 and ranges[-1][1] == 1023
    assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(ranges))
    sizes = [last - first + 1 for first, last in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_four_shards_hold_a_quarter_each() -> None:
    assert even_ranges(4) == [(0, 255), (256, 511), (512, 767), (768, 1023)]


def test_shard_counts_are_read_and_bad_ones_refused() -> None:
    assert parse_counts("1,2,4") == [1, 2, 4] and parse_counts(" 4 ") == [4]
    for bad in ("", "0", "1,1", "a,2", "17"):
        with pytest.raises(ValueError, match="numbers of shards"):
            parse_counts(bad)
    assert _parser().parse_args(["shards"]).shards == [1, 2, 4]
    with pytest.raises(SystemExit):
        _parser().parse_args(["shards", "--shards", "2,2"])
