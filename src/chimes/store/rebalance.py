"""Planning moves that even out the work of the homes (docs/scaling.md, "Rebalancing").

A home is the catalog or a shard; each holds some of the 1,024 partitions. The load of a home is
what its partitions hold: jobs, or triggers due within the next hour. :func:`plan_moves` proposes
moves of contiguous ranges, each within one home (a move's range lives in one home), from the most
loaded home to the least loaded, until no move narrows the gap between them by more than
:data:`MIN_GAIN` of the mean load per home. The planning functions are pure: no clock, no I/O;
:func:`read_counts` reads the counts of every home.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import asyncpg

from chimes.ids import PARTITION_COUNT
from chimes.store import db
from chimes.store.moves import home_name
from chimes.store.queries import sql
from chimes.store.shards import ShardMap, ShardMapError

Home = int | None  # a shard's id; None: the catalog
MIN_GAIN = 0.05  # a move must narrow the gap it closes by more than this share of the mean load per home
MAX_MOVES = 32  # a plan longer than this is cut: each move fences its range for a while
DUE_WINDOW_SEC = 3600  # --by due: the triggers due within the next hour
MEASURES = ("jobs", "due")


@dataclass(frozen=True, slots=True)
class ProposedMove:
    first: int
    last: int
    source: Home
    target: Home
    load: int  # what the range holds (jobs or due triggers)

    def command(self) -> str:
        """The ``chimes shards move`` command that makes this move."""
        return f"chimes shards move {self.first}-{self.last} --to {home_label(self.target)}"


@dataclass(frozen=True, slots=True)
class Plan:
    homes: tuple[Home, ...]
    before: dict[Home, int]
    after: dict[Home, int]
    moves: tuple[ProposedMove, ...]

    @property
    def spread_before(self) -> int:
        return spread(self.before)

    @property
    def spread_after(self) -> int:
        return spread(self.after)


def home_label(home: Home) -> str:
    """How ``--to`` names a home: 'catalog' or the shard's id."""
    return "catalog" if home is None else str(home)


def spread(loads: Mapping[Home, int]) -> int:
    return max(loads.values()) - min(loads.values()) if loads else 0


def owners_of(shard_map: ShardMap) -> list[Home]:
    """The home of each partition, by partition id."""
    owners: list[Home] = [None] * PARTITION_COUNT
    for shard_range in shard_map.ranges:
        for partition in range(shard_range.first, shard_range.last + 1):
            owners[partition] = shard_range.shard_id
    return owners


def homes_of(owners: Sequence[Home]) -> tuple[Home, ...]:
    """The homes that hold a partition, the catalog first, then the shards by id. A catalog that
    holds none (every partition given to shards) is left out: it gets nothing back."""
    held = set(owners)
    shards = sorted(h for h in held if h is not None)
    return (None, *shards) if None in held else tuple(shards)


def runs_of(owners: Sequence[Home], home: Home) -> list[tuple[int, int]]:
    """The maximal runs of contiguous partitions that ``home`` holds, in order (two ranges of a
    shard that touch are one run: a move may span both)."""
    runs: list[tuple[int, int]] = []
    start: int | None = None
    for partition, owner in enumerate(owners):
        if owner == home and start is None:
            start = partition
        elif owner != home and start is not None:
            runs.append((start, partition - 1))
            start = None
    if start is not None:
        runs.append((start, len(owners) - 1))
    return runs


def edge_ranges(runs: Sequence[tuple[int, int]], counts: Mapping[int, int]) -> list[tuple[int, int, int]]:
    """Every range at the edge of a run, (first, last, load): each run's prefixes and suffixes, the
    whole run once. Taking from an edge keeps the donor's runs whole."""
    found: list[tuple[int, int, int]] = []
    for first, last in runs:
        load = 0
        for end in range(first, last + 1):
            load += counts.get(end, 0)
            found.append((first, end, load))
        load = 0
        for start in range(last, first, -1):  # the whole run is a prefix already
            load += counts.get(start, 0)
            found.append((start, last, load))
    return found


def loads_of(owners: Sequence[Home], counts: Mapping[int, int]) -> dict[Home, int]:
    """The load of each home (in :func:`homes_of` order): the sum over the partitions it holds."""
    loads = {home: 0 for home in homes_of(owners)}
    for partition, owner in enumerate(owners):
        loads[owner] += counts.get(partition, 0)
    return loads


def best_move(owners: Sequence[Home], counts: Mapping[int, int], donor: Home, receiver: Home,
              amount: float) -> ProposedMove | None:
    """The edge range of ``donor`` whose load is closest to ``amount``; of those, one that touches a
    range of ``receiver`` (the map keeps fewer ranges), then the shortest. None when the donor holds
    nothing to move."""
    def touches_receiver(first: int, last: int) -> bool:
        return ((first > 0 and owners[first - 1] == receiver)
                or (last + 1 < len(owners) and owners[last + 1] == receiver))

    best: tuple[tuple[float, bool, int], ProposedMove] | None = None
    for first, last, load in edge_ranges(runs_of(owners, donor), counts):
        if load <= 0:
            continue
        key = (abs(amount - load), not touches_receiver(first, last), last - first)
        if best is None or key < best[0]:
            best = (key, ProposedMove(first, last, donor, receiver, load))
    return None if best is None else best[1]


def plan_moves(owners: Sequence[Home], counts: Mapping[int, int], *, min_gain: float = MIN_GAIN,
               max_moves: int = MAX_MOVES) -> Plan:
    """Greedy: the most loaded home gives the least loaded what brings one of them to the mean (an
    edge range of its runs, :func:`best_move`), while that narrows the gap between the two by more
    than ``min_gain`` of the mean. Aiming at the mean, not at half the gap, keeps a home from taking
    more than its share and handing partitions on again. ``owners`` gives the home of each
    partition, ``counts`` the load of each (a partition not in it holds nothing). Each move is
    planned on the map the moves before it leave, so the moves are made in order."""
    owners = list(owners)
    homes = homes_of(owners)
    loads = loads_of(owners, counts)
    before = dict(loads)
    mean = sum(loads.values()) / len(homes) if homes else 0.0
    moves: list[ProposedMove] = []
    while len(homes) > 1 and len(moves) < max_moves:
        donor = max(homes, key=loads.__getitem__)
        receiver = min(homes, key=loads.__getitem__)
        gap = loads[donor] - loads[receiver]
        move = best_move(owners, counts, donor, receiver, min(loads[donor] - mean, mean - loads[receiver]))
        if move is None or gap - abs(gap - 2 * move.load) <= min_gain * mean:
            break
        loads[donor] -= move.load
        loads[receiver] += move.load
        owners[move.first:move.last + 1] = [receiver] * (move.last - move.first + 1)
        moves.append(move)
    return Plan(homes, before, dict(loads), tuple(moves))


def describe_loads(loads: Mapping[Home, int], unit: str) -> str:
    return ", ".join(f"{home_name(home)} {load:,}" for home, load in loads.items()) + f" {unit}"


async def read_counts(catalog_url: str, shard_map: ShardMap, by: str) -> dict[int, int]:
    """The load of each partition, read on the home that holds it (``by``: 'jobs', or 'due': the
    triggers due within the next hour), every home at once. Rows a home keeps of partitions it does
    not hold are not counted. ShardMapError names a home that did not answer."""
    if by not in MEASURES:
        raise ShardMapError(f"--by {by!r}: must be one of {', '.join(MEASURES)}")
    owners = owners_of(shard_map)
    urls: dict[Home, str] = {None: catalog_url, **{r.shard_id: r.url for r in shard_map.ranges}}

    async def read(conn: asyncpg.Connection) -> list[asyncpg.Record]:
        if by == "jobs":
            return list(await conn.fetch(sql("partition_job_counts")))
        return list(await conn.fetch(sql("partition_due_counts"), float(DUE_WINDOW_SEC)))

    homes = list(urls)
    found = await asyncio.gather(*(db.with_connection(urls[home], read) for home in homes), return_exceptions=True)
    counts: dict[int, int] = {}
    for home, rows in zip(homes, found, strict=True):
        if isinstance(rows, BaseException):
            raise ShardMapError(f"{home_name(home)} did not answer ({db.describe(rows)}): "
                                "rebalancing reads every home") from rows
        for row in rows:
            partition = int(row["partition_id"])
            if owners[partition] == home:
                counts[partition] = counts.get(partition, 0) + int(row[1])
    return counts
