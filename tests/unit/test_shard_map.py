"""The shard map's pure parts: parsing a range of partitions, finding a partition's home, the catalog's
ranges, and URLs shown without their password."""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from chimes.ids import new_job_id_in, partition_of, partition_of_key
from chimes.store.dashboard import (
    QUEUE_COUNT_CAP,
    FleetGauges,
    JobCursor,
    JobPage,
    QueueTier,
    add_up,
    merge_job_pages,
)
from chimes.store.jobs import SPEC_COLUMNS, JobColumns, JobRecord
from chimes.store.shards import ShardMap, ShardMapError, ShardRange, parse_partitions, without_password

EPOCH = datetime(2026, 1, 1, tzinfo=UTC)


def a_map(*ranges: tuple[int, int, int]) -> ShardMap:
    return ShardMap(len(ranges), tuple(ShardRange(first, last, shard, f"postgresql://h{shard}/db", 1)
                                       for first, last, shard in ranges))


@pytest.mark.parametrize(("text", "expected"), [("0-1023", (0, 1023)), ("512-1023", (512, 1023)), ("7-7", (7, 7)),
                                                (" 3 - 9 ", (3, 9))])
def test_a_range_of_partitions_is_parsed(text: str, expected: tuple[int, int]) -> None:
    assert parse_partitions(text) == expected


@pytest.mark.parametrize(("text", "says"), [
    ("512", "must be FIRST-LAST"), ("512-", "must be FIRST-LAST"), ("-3-9", "must be FIRST-LAST"),
    ("a-b", "must be FIRST-LAST"), ("1.5-3", "must be FIRST-LAST"), ("", "must be FIRST-LAST"),
    ("9-3", "the first not after the last"), ("0-1024", "within 0-1023"), ("1024-1100", "within 0-1023"),
    ("00000-3", "must be FIRST-LAST"),
])
def test_a_malformed_range_is_refused_with_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ShardMapError, match=says):
        parse_partitions(text)


def test_the_empty_map_leaves_every_partition_to_the_catalog() -> None:
    empty = a_map()
    assert all(empty.range_of(p) is None for p in range(1024))
    assert empty.in_catalog() == [(0, 1023)]


def test_each_partition_has_the_home_its_range_gives_it() -> None:
    shard_map = a_map((100, 199, 1), (512, 1023, 2))
    homes = [r.shard_id if (r := shard_map.range_of(p)) else 0 for p in range(1024)]
    assert homes == [0] * 100 + [1] * 100 + [0] * 312 + [2] * 512
    assert shard_map.in_catalog() == [(0, 99), (200, 511)]
    assert a_map((0, 1023, 1)).in_catalog() == []


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql://chimes:s3cret@db1:5432/chimes", "postgresql://chimes:***@db1:5432/chimes"),
    ("postgresql://chimes@db1/chimes?sslmode=require", "postgresql://chimes@db1/chimes?sslmode=require"),
    ("postgresql://u:p@h1:5432,h2:5432/db", "postgresql://u:***@h1:5432,h2:5432/db"),
    ("postgresql:///chimes?host=/run/postgresql", "postgresql:///chimes?host=/run/postgresql"),
])
def test_a_url_is_shown_without_its_password(url: str, shown: str) -> None:
    assert without_password(url) == shown


@pytest.mark.parametrize("partition", [0, 1, 511, 512, 1023])
def test_a_job_id_can_be_made_in_a_given_partition(partition: int) -> None:
    ids = [new_job_id_in(partition) for _ in range(3)]
    assert {partition_of(job_id) for job_id in ids} == {partition}
    assert len(set(ids)) == 3 and all(job_id.version == 7 for job_id in ids)


@pytest.mark.parametrize("partition", [-1, 1024])
def test_no_job_id_outside_the_partitions(partition: int) -> None:
    with pytest.raises(ValueError, match="must lie within 0-1023"):
        new_job_id_in(partition)


def test_an_idempotency_key_names_one_partition_per_owner() -> None:
    assert partition_of_key("team-a", "k1") == partition_of_key("team-a", "k1")
    spread = {partition_of_key("team-a", f"k{i}") for i in range(2000)}
    assert len(spread) > 800  # keys spread over the partitions, so over the shards
    # The owner counts: "team-a" + "bk" and "team-ab" + "k" are different keys.
    assert partition_of_key("team-a", "bk") != partition_of_key("team-ab", "k")


@pytest.mark.parametrize("pattern", ["order-{:03d}", "order-{:04d}", "k{}", "nightly-report-{}"])
def test_numbered_idempotency_keys_spread_over_both_halves_of_the_partitions(pattern: str) -> None:
    """Keys a client numbers: every run of 20 in a row has jobs in both halves (two shards), as a hash
    would have them; CRC-32 put each run of 20 in one half."""
    halves = [partition_of_key("team-a", pattern.format(i)) * 2 // 1024 for i in range(200)]
    for start in range(0, 200, 20):
        assert 0 < sum(halves[start:start + 20]) < 20, (pattern, start)


_NO_COLUMNS = JobColumns(**dict.fromkeys(SPEC_COLUMNS))  # only the name is read here


def _page(names: list[str], more: bool) -> JobPage:
    keys = [JobCursor(name, uuid.UUID(int=i + 1)) for i, name in enumerate(names)]
    jobs = [JobRecord(job_id=k.job_id, owner="team-a", columns=replace(_NO_COLUMNS, name=k.name), paused=False,
                      version=1, created_at=EPOCH, updated_at=EPOCH, next_run_at=None, last_run=None) for k in keys]
    return JobPage(jobs, keys[-1] if more else None, keys)


def test_pages_of_jobs_from_several_databases_merge_in_the_index_order() -> None:
    # "C" collation: bytes order, so "Z" < "a" < "é" (0xC3 0xA9) and "a" < "ab".
    merged = merge_job_pages([_page(["a", "é"], more=False), _page(["Z", "ab"], more=False)], limit=3)
    assert [k.name for k in merged.keys] == ["Z", "a", "ab"]
    assert [j.columns.name for j in merged.jobs] == ["Z", "a", "ab"]
    assert merged.next == merged.keys[-1]  # "é" is left for the next page
    last = merge_job_pages([_page(["a"], more=False), _page(["b"], more=False)], limit=3)
    assert last.next is None and [k.name for k in last.keys] == ["a", "b"]
    # A database that had more than it listed: the page ends with a cursor even if all fit.
    assert merge_job_pages([_page(["a"], more=True), _page([], more=False)], limit=3).next == JobCursor(
        "a", uuid.UUID(int=1))
    assert merge_job_pages([_page([], more=False)], limit=3) == JobPage([], None, [])


def test_the_gauges_of_several_databases_add_up() -> None:
    catalog = FleetGauges([QueueTier("high", 3, 2.0), QueueTier("normal", 0, None)], nodes=2, workers=3, unleased=0)
    shard = FleetGauges([QueueTier("high", 4, 5.0), QueueTier("normal", QUEUE_COUNT_CAP, 1.0)], nodes=2, workers=2,
                        unleased=1024)
    assert add_up([catalog, shard]) == FleetGauges(
        [QueueTier("high", 7, 5.0), QueueTier("normal", QUEUE_COUNT_CAP, 1.0)], nodes=2, workers=3, unleased=1024)
