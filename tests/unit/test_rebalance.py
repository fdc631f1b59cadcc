"""Planning a rebalance (chimes.store.rebalance): pure functions over a map and per-partition counts."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import pytest

from chimes.ids import PARTITION_COUNT
from chimes.store.rebalance import (
    MAX_MOVES,
    Home,
    Plan,
    edge_ranges,
    homes_of,
    loads_of,
    owners_of,
    plan_moves,
    runs_of,
    spread,
)
from chimes.store.shards import ShardMap, ShardRange


def owners(*ranges: tuple[int, int, int]) -> list[Home]:
    """The home of each partition for shard ranges (first, last, shard); the rest: the catalog."""
    shard_map = ShardMap(1, tuple(ShardRange(f, last, s, f"postgresql:///s{s}", 1) for f, last, s in ranges))
    return owners_of(shard_map)


def even(first: int = 0, last: int = PARTITION_COUNT - 1, per_partition: int = 1) -> dict[int, int]:
    return dict.fromkeys(range(first, last + 1), per_partition)


def check_plan(before: Sequence[Home], counts: Mapping[int, int], plan: Plan) -> list[Home]:
    """Every move takes a range that lives in one home, at an edge of that home's runs, and the
    loads the plan gives are those the moves leave; the map after the moves."""
    now = list(before)
    for move in plan.moves:
        assert move.source != move.target
        assert set(now[move.first:move.last + 1]) == {move.source}, f"{move} spans homes"
        runs = runs_of(now, move.source)
        assert any(move.first == first or move.last == last for first, last in runs
                   if first <= move.first <= last), f"{move} is not at an edge"
        assert move.load == sum(counts.get(p, 0) for p in range(move.first, move.last + 1))
        now[move.first:move.last + 1] = [move.target] * (move.last - move.first + 1)
    assert plan.before == loads_of(before, counts)
    assert plan.after == loads_of(now, counts) | {h: 0 for h in plan.homes if h not in loads_of(now, counts)}
    return now


def test_each_partition_has_one_home_and_a_shards_touching_ranges_are_one_run() -> None:
    found = owners((100, 199, 1), (200, 299, 1), (600, 1023, 2))
    assert found[0] is None and found[150] == 1 and found[250] == 1 and found[599] is None and found[1023] == 2
    assert homes_of(found) == (None, 1, 2)
    assert runs_of(found, 1) == [(100, 299)]
    assert runs_of(found, None) == [(0, 99), (300, 599)]
    assert runs_of(found, 2) == [(600, 1023)]


def test_a_catalog_that_holds_no_partition_is_no_home() -> None:
    assert homes_of(owners((0, 511, 1), (512, 1023, 2))) == (1, 2)


def test_edge_ranges_are_each_runs_prefixes_and_suffixes() -> None:
    counts = {10: 1, 11: 2, 12: 3}
    assert sorted(edge_ranges([(10, 12)], counts)) == sorted([
        (10, 10, 1), (10, 11, 3), (10, 12, 6), (12, 12, 3), (11, 12, 5)])


def test_one_home_proposes_nothing() -> None:
    plan = plan_moves(owners(), even())
    assert plan.homes == (None,) and not plan.moves and plan.after == plan.before == {None: 1024}


def test_an_empty_shard_gets_half_of_the_catalogs_jobs_from_one_edge() -> None:
    before = owners((1000, 1023, 1))
    counts = even(0, 999, 2)  # the shard's partitions hold nothing
    plan = plan_moves(before, counts)
    assert plan.before == {None: 2000, 1: 0}
    assert plan.after == {None: 1000, 1: 1000}
    assert [(m.first, m.last, m.source, m.target) for m in plan.moves] == [(500, 999, None, 1)]
    assert plan.moves[0].command() == "chimes shards move 500-999 --to 1"
    check_plan(before, counts, plan)


def test_a_move_back_to_the_catalog_names_it() -> None:
    assert not plan_moves(owners((0, 511, 3)), even()).moves  # balanced: nothing
    plan = plan_moves(owners((0, 511, 3)), even(0, 511))
    assert [m.command() for m in plan.moves] == ["chimes shards move 256-511 --to catalog"]
    assert not plan_moves(owners((0, 1023, 3)), even()).moves  # the catalog holds no partition: one home


def test_four_homes_end_within_a_few_percent() -> None:
    before = owners((256, 511, 1), (512, 767, 2), (768, 1023, 3))
    counts = {**even(0, 255, 10), **even(256, 511, 1)}  # the catalog has ten times shard 1's; 2 and 3 none
    plan = plan_moves(before, counts)
    assert plan.spread_before == 2560
    mean = sum(counts.values()) / 4
    assert plan.spread_after <= 0.05 * mean + 10  # a few percent, or one partition's jobs
    check_plan(before, counts, plan)


def test_no_move_when_the_gain_is_under_the_threshold() -> None:
    before = owners((512, 1023, 1))
    catalog = even(0, 511, 100)  # 51,200 jobs; shard 1 holds its jobs in partition 600
    # A gap of 4,000 (8% of the mean) closes with a move of 2,000 jobs: worth it.
    assert [m.load for m in plan_moves(before, {**catalog, 600: 47_200}).moves] == [2_000]
    # A gap of 2,000 narrows by at most 2,000, under 5% of the mean (2,510): it is not.
    assert not plan_moves(before, {**catalog, 600: 49_200}).moves


def test_a_hot_partition_that_cannot_be_split_is_left_where_it_is() -> None:
    before = owners((512, 1023, 1))
    counts = {**even(), 7: 5000}  # one partition holds most jobs of the catalog
    plan = plan_moves(before, counts)
    check_plan(before, counts, plan)
    assert plan.spread_after <= plan.spread_before
    assert all(not (m.first <= 7 <= m.last) or m.target == 1 for m in plan.moves)
    assert len(plan.moves) <= 2


def test_nothing_to_even_out_when_every_home_is_empty_or_equal() -> None:
    assert not plan_moves(owners((512, 1023, 1)), {}).moves
    assert not plan_moves(owners((512, 1023, 1)), even()).moves


def test_plans_stop_at_the_most_moves() -> None:
    before = owners((1023, 1023, 1))
    assert len(plan_moves(before, even(0, 1022), max_moves=0).moves) == 0
    assert len(plan_moves(before, even(0, 1022), max_moves=1).moves) == 1


@pytest.mark.parametrize("seed", range(40))
def test_random_maps_and_counts_give_valid_plans_that_never_widen_the_spread(seed: int) -> None:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, PARTITION_COUNT), rng.randint(1, 7)))
    bounds = list(zip([0, *cuts], [c - 1 for c in cuts] + [PARTITION_COUNT - 1], strict=True))
    shards = rng.sample(range(1, 5), k=min(len(bounds), 4))
    ranges = [(first, last, rng.choice(shards)) for first, last in bounds if rng.random() < 0.7]
    before = owners(*ranges)
    skew = rng.choice([0, 1, 5, 50])
    counts = {p: rng.randint(0, 3) + (skew if p < rng.randint(0, 1023) else 0) for p in range(PARTITION_COUNT)}
    plan = plan_moves(before, counts)
    check_plan(before, counts, plan)
    assert len(plan.moves) <= MAX_MOVES
    assert plan.spread_after <= plan.spread_before
    assert sum(plan.after.values()) == sum(plan.before.values())
    if len(plan.homes) > 1 and plan.before:
        biggest = max(counts.values())
        mean = sum(counts.values()) / len(plan.homes)
        # Balanced to a few percent of the mean, unless single partitions are too big to even it out.
        assert plan.spread_after <= 0.05 * mean + 2 * biggest or len(plan.moves) == MAX_MOVES
    assert spread(plan.after) == plan.spread_after
    moved = [p for m in plan.moves for p in range(m.first, m.last + 1)]
    assert len(moved) == len(set(moved)), "a partition moved twice"  # a home takes no more than its share


def test_three_homes_fill_up_to_the_mean_without_handing_partitions_on() -> None:
    before = owners((512, 767, 1), (768, 1023, 2))
    counts = {**even(0, 511, 120), **even(512, 767, 80), **even(768, 1023, 16)}  # 61,440, 20,480 and 4,096
    plan = plan_moves(before, counts)
    check_plan(before, counts, plan)
    assert [(m.source, m.target) for m in plan.moves] == [(None, 2), (None, 1)]
    assert plan.after == {None: 28_680, 1: 28_640, 2: 28_696}
