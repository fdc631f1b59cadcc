"""Concurrency caps across shards: slots in the catalog (docs/scaling.md, "Caps and quotas across shards").

With one database a capped claim counts the running runs under a lock (chimes.store.working). With
a shard map that gives partitions to other databases no one database sees every running run, so a
capped run first takes one slot of each cap it falls under in the catalog's ``cap_slots``, counted
under one lock for the whole fleet, and only then is claimed on its home. The run's outcome frees
its slots, the worker's heartbeat renews them, and the slots of a worker that stopped renewing them
are deleted by the next count. A crash between taking the slots and the claim leaves them taken
until their lease lapses: the cap is briefly under-used, never exceeded.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence

import asyncpg

from chimes.store.caps import Cap, CapKey, cap_key, list_caps
from chimes.store.db import DB_ERRORS, Conn
from chimes.store.queries import sql

log = logging.getLogger(__name__)

CAPS_RECHECK_SEC = 2.0


def rooms_of(rows: Iterable[asyncpg.Record]) -> dict[CapKey, int]:
    """The room left under each cap, from rows of cap_usage or cap_slot_usage."""
    return {cap_key(r["scope"], r["name"], r["owner"]): max(0, r["max_running"] - r["running"]) for r in rows}


def full_caps(rooms: Mapping[CapKey, int]) -> tuple[list[str], list[str], list[str], list[str]]:
    """The parameters $4-$7 of capped_candidates: owners, fleet-wide tags, and (owner, tag) pairs of
    the caps that have no room left."""
    full = [key for key, room in rooms.items() if room == 0]
    owner_tags = [key for key in full if len(key) == 3]
    owners = [key[1] for key in full if key[0] == "owner"]
    fleet_tags = [key[1] for key in full if key[0] == "tag" and len(key) == 2]
    return owners, fleet_tags, [key[2] for key in owner_tags], [key[1] for key in owner_tags]


class CapSlots:
    """The catalog's cap slots, shared by every claim loop of a worker process whose shard map has
    ranges. Also keeps the catalog's caps, read again every few seconds, for the shards' claims:
    a shard's own ``concurrency_caps`` is empty."""

    def __init__(self, catalog: asyncpg.Pool, recheck_sec: float = CAPS_RECHECK_SEC) -> None:
        self.catalog = catalog
        self._recheck_sec = recheck_sec
        self._caps: list[Cap] = []
        self._read_at: float | None = None  # monotonic; None: never read

    async def caps(self, *, fresh: bool = False) -> list[Cap]:
        """The caps as the catalog held them at most a few seconds ago, or now (``fresh``: a shard's
        claim, which must not take a run a cap set a moment ago now covers). While the catalog does
        not answer, the last ones read (asked again every few seconds): a shard's runs under no cap
        are still claimed, those under a cap wait, as taking a slot needs the catalog. Never read
        yet: the catalog's error."""
        now = time.monotonic()
        if self._read_at is None or now >= self._read_at + self._recheck_sec or (fresh and now > self._read_at):
            known = self._read_at is not None
            try:
                self._caps = await list_caps(self.catalog)
            except DB_ERRORS:
                if not known:
                    raise
                log.warning("the catalog's caps could not be read; claiming by the last ones read")
            self._read_at = now
        return self._caps

    @staticmethod
    async def count(conn: Conn) -> dict[CapKey, int]:
        """In the caller's catalog transaction: take the slots' lock (held to its end), drop lapsed
        slots, and return the room left under each cap."""
        await conn.execute(sql("lock_cap_slots"))
        await conn.execute(sql("drop_lapsed_cap_slots"))
        return rooms_of(await conn.fetch(sql("cap_slot_usage")))

    @staticmethod
    async def take(conn: Conn, slots: Sequence[tuple[CapKey, uuid.UUID]], shard_id: int | None, holder: str,
                   lease_sec: float) -> None:
        """In the caller's catalog transaction, after :meth:`count`: one slot per (cap, run)."""
        if not slots:
            return
        keys = [key + ("",) * (3 - len(key)) for key, _ in slots]  # a key without an owner has ''
        await conn.execute(sql("take_cap_slots"), [k[0] for k in keys], [k[1] for k in keys], [k[2] for k in keys],
                           [run_id for _, run_id in slots], shard_id, holder, lease_sec)

    async def free(self, run_ids: Sequence[uuid.UUID], holder: str) -> None:
        if run_ids:
            await self.catalog.execute(sql("free_cap_slots"), list(run_ids), holder)

    async def renew(self, run_ids: Sequence[uuid.UUID], holder: str, lease_sec: float) -> None:
        if run_ids:
            await self.catalog.execute(sql("renew_cap_slots"), list(run_ids), holder, lease_sec)
