"""Concurrency caps as the operator sets them (``chimes cap``), and the keys the worker's admission
(chimes.worker.caps) counts them by."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import asyncpg

from chimes.store.queries import sql

#: ("owner", "team-a"); ("tag", "db-heavy", "team-a"): team-a's jobs with the tag; ("tag", "db-heavy"):
#: every owner's jobs with the tag (fleet-wide).
CapKey = tuple[str, ...]


def cap_key(scope: str, name: str, owner: str = "") -> CapKey:
    """The key of a cap row: an owner cap or a fleet-wide tag cap has no owner ('')."""
    return (scope, name, owner) if owner else (scope, name)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A queued run that falls under at least one cap, as a claim sees it."""

    queue_id: int
    owner: str
    tags: Sequence[str]


def caps_of(candidate: Candidate, rooms: Mapping[CapKey, int]) -> list[CapKey]:
    """The keys of the caps in ``rooms`` that ``candidate`` falls under."""
    keys: list[CapKey] = [("owner", candidate.owner)]
    for tag in candidate.tags:
        keys += [("tag", tag), ("tag", tag, candidate.owner)]
    return [key for key in keys if key in rooms]


@dataclass(frozen=True, slots=True)
class Cap:
    scope: str  # owner | tag
    name: str  # the owner, or the tag
    owner: str  # whose jobs a tag cap counts; '' for an owner cap or a fleet-wide tag cap
    max_running: int


async def set_cap(conn: asyncpg.Connection | asyncpg.Pool, cap: Cap) -> None:
    await conn.execute(sql("set_cap"), cap.scope, cap.name, cap.owner, cap.max_running)


async def remove_cap(conn: asyncpg.Connection | asyncpg.Pool, scope: str, name: str, owner: str) -> bool:
    """False when there was no such cap."""
    return await conn.fetchval(sql("remove_cap"), scope, name, owner) is not None


async def list_caps(conn: asyncpg.Connection | asyncpg.Pool) -> list[Cap]:
    return [Cap(**dict(row)) for row in await conn.fetch(sql("list_caps"))]
