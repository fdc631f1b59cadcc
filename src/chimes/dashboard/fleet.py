"""The fleet page over shards: each home's fleet read on its own database, then added up into one
(docs/scaling.md, "Shards"). Every scheduler and worker process serves every home under one id, so
nodes and workers are matched by id; a node counts as holding a partition only on the home that holds
that partition (every database has all 1,024 lease rows, and the others are empty there)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from chimes.ids import PARTITION_COUNT
from chimes.store.dashboard import QUEUE_COUNT_CAP, RUNNING_SHOWN, FireLag, Fleet, QueueTier
from chimes.store.db import Pool
from chimes.store.moves import Move, recent_moves

LIVE_NODE_SEC = 15  # as the fleet page marks a node "not heartbeating"
MOVES_SHOWN = 5  # the move under way, if any, and the last ones that ended


@dataclass(frozen=True, slots=True)
class HomeSummary:
    """One database of the map, as the fleet page's "Shards" table shows it."""

    name: str  # "catalog" or "shard N"
    partitions: tuple[int, ...]  # the partitions this database holds
    held: int  # of those, leased by a live node
    live_nodes: int
    in_flight: int
    queued: int | None  # None: not read (the queue is for admins)
    fire_lag_p99: float | None
    failed: int
    error: str | None = None  # the database did not answer


@dataclass(frozen=True, slots=True)
class MovesShown:
    """The fleet page's "Partition moves" table: the move under way first, then the last ended."""

    moves: tuple[Move, ...]
    error: str | None = None  # the catalog did not answer

    @property
    def under_way(self) -> Move | None:
        return self.moves[0] if self.moves and self.moves[0].under_way else None


async def moves_shown(catalog: Pool) -> MovesShown:
    """The catalog's moves (``shard_moves``); a catalog that does not answer is named, and the rest
    of the page, read from the other homes, still shows."""
    try:
        return MovesShown(tuple(await recent_moves(catalog, MOVES_SHOWN)))
    except Exception as exc:
        return MovesShown((), error=type(exc).__name__)


def summarize(name: str, own: Sequence[int], fleet: Fleet | BaseException, with_queue: bool) -> HomeSummary:
    if isinstance(fleet, BaseException):
        return HomeSummary(name=name, partitions=tuple(own), held=0, live_nodes=0, in_flight=0, queued=None,
                           fire_lag_p99=None, failed=0, error=type(fleet).__name__)
    mine = set(own)
    live = [n for n in fleet.nodes if n["heartbeat_age"] < LIVE_NODE_SEC]
    held = mine.intersection(p for n in fleet.nodes for p in n["partitions"])
    return HomeSummary(name=name, partitions=tuple(own), held=len(held), live_nodes=len(live),
                       in_flight=sum(w["in_flight"] for w in fleet.workers),
                       queued=sum(t.depth for t in fleet.queue) if with_queue else None,
                       fire_lag_p99=fleet.fire_lag.p99, failed=sum(r["failed"] for r in fleet.failures))


def add_up(fleets: Sequence[Fleet], owns: Sequence[Sequence[int]]) -> Fleet:
    """The fleets of the homes that answered as one: a node's partitions are those it holds on the
    home that holds them, out of all 1,024 (a home that did not answer holds its partitions unleased
    as far as anyone can tell); workers' runs in flight added up; the queue, the lag histogram and the
    failures per minute added up; lag percentiles the worst home's (a bound, not a merge)."""
    nodes: dict[str, dict[str, Any]] = {}
    for fleet, own in zip(fleets, owns, strict=True):
        mine = set(own)
        for row in fleet.nodes:
            node = nodes.setdefault(row["node_id"], {**dict(row), "partitions": []})
            if row["heartbeat_age"] < node["heartbeat_age"]:
                node.update(heartbeat_at=row["heartbeat_at"], heartbeat_age=row["heartbeat_age"])
            node["partitions"] += [p for p in row["partitions"] if p in mine]
    for node in nodes.values():
        node["partitions"].sort()
    workers: dict[str, dict[str, Any]] = {}
    for fleet in fleets:
        for row in fleet.workers:
            worker = workers.setdefault(row["worker_id"], {**dict(row), "in_flight": 0})
            worker["in_flight"] += row["in_flight"]
            if row["heartbeat_age"] < worker["heartbeat_age"]:
                worker.update(heartbeat_at=row["heartbeat_at"], heartbeat_age=row["heartbeat_age"])
    held = sum(len(n["partitions"]) for n in nodes.values())
    merged = Fleet(
        nodes=sorted(nodes.values(), key=lambda n: n["node_id"]),  # type: ignore[arg-type]
        unleased=PARTITION_COUNT - held,
        workers=sorted(workers.values(), key=lambda w: w["worker_id"]),  # type: ignore[arg-type]
        running=list(heapq.merge(*(f.running for f in fleets), key=lambda r: r["started_at"]))[:RUNNING_SHOWN],
        queue=_queue([f.queue for f in fleets]),
        fire_lag=_fire_lag([f.fire_lag for f in fleets]),
        failures=_failures([f.failures for f in fleets]),  # type: ignore[arg-type]
        api_servers=[server for fleet in fleets for server in fleet.api_servers],  # the catalog's only
    )
    for run in merged.running:
        merged.running_by_worker.setdefault(run["worker_id"], []).append(run)
    return merged


def _queue(homes: list[list[QueueTier]]) -> list[QueueTier]:
    tiers = [tiers for tiers in zip(*homes, strict=True)]
    return [QueueTier(same[0].tier, min(QUEUE_COUNT_CAP, sum(t.depth for t in same)),
                      max((t.oldest_sec for t in same if t.oldest_sec is not None), default=None))
            for same in tiers]


def _fire_lag(homes: list[FireLag]) -> FireLag:
    def worst(values: list[float | None]) -> float | None:
        return max((v for v in values if v is not None), default=None)

    buckets = [sum(counts) for counts in zip(*(h.buckets for h in homes), strict=True)] if homes else []
    return FireLag(sum(h.runs for h in homes), worst([h.p50 for h in homes]), worst([h.p99 for h in homes]),
                   worst([h.max for h in homes]), buckets)


def _failures(homes: list[list[Any]]) -> list[dict[str, Any]]:
    per_minute: dict[Any, int] = {}
    for rows in homes:
        for row in rows:
            per_minute[row["minute"]] = per_minute.get(row["minute"], 0) + row["failed"]
    return [{"minute": minute, "failed": failed} for minute, failed in sorted(per_minute.items())]
