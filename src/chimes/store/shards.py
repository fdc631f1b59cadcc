"""The shard map: which database holds which of the 1,024 trigger partitions (docs/scaling.md, "Shards").

The map is kept in the catalog, the database of the configured URL. A partition in no range of the
map lives in the catalog itself, so the empty map is the single database: everything goes to the
catalog's pool and nothing else is opened. :class:`ShardPools` gives the pool for a partition or a
job, opening one pool per shard when it is first needed, each bounded like the catalog's.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from chimes.ids import PARTITION_COUNT, partition_of
from chimes.store import db
from chimes.store.migrate import migrate
from chimes.store.queries import sql

_RANGE = re.compile(r"^\s*(\d{1,4})\s*-\s*(\d{1,4})\s*$")
_JOB_ID_BATCH = 10_000


PARTITION_MOVED = "CH001"  # the SQLSTATE of the catalog's fence (migration 0010)


def partition_moved(error: BaseException) -> bool:
    """True when ``error`` is the catalog refusing a job whose partition a shard holds: the map the
    writer routed by is older than the catalog's."""
    return isinstance(error, asyncpg.PostgresError) and getattr(error, "sqlstate", None) == PARTITION_MOVED


class ShardMapError(ValueError):
    """A change of the map that was refused; the message says why, and nothing was changed."""


@dataclass(frozen=True, slots=True)
class ShardRange:
    """Partitions ``first`` to ``last`` (both included), held by shard ``shard_id`` at ``url``."""

    first: int
    last: int
    shard_id: int
    url: str
    since_version: int

    def __contains__(self, partition: object) -> bool:
        return isinstance(partition, int) and self.first <= partition <= self.last


@dataclass(frozen=True, slots=True)
class ShardMap:
    """The map as one version of it was read: the ranges in partition order."""

    version: int
    ranges: tuple[ShardRange, ...]

    def range_of(self, partition: int) -> ShardRange | None:
        """The range holding ``partition``; None: the catalog holds it."""
        for shard_range in self.ranges:
            if partition in shard_range:
                return shard_range
        return None

    def urls(self) -> list[str]:
        """The URL of each shard, once each, in the order of their first ranges."""
        return list(dict.fromkeys(r.url for r in self.ranges))

    def homes(self) -> list[tuple[str, frozenset[int]]]:
        """Each home's name and partitions, in the order of :meth:`ShardPools.homes` and of
        :meth:`urls`: the catalog first, then each shard in the order of its first range."""
        catalog = frozenset(p for first, last in self.in_catalog() for p in range(first, last + 1))
        shards: dict[int, set[int]] = {}
        for shard_range in self.ranges:
            shards.setdefault(shard_range.shard_id, set()).update(range(shard_range.first, shard_range.last + 1))
        return [("catalog", catalog), *((f"shard {shard_id}", frozenset(held)) for shard_id, held in shards.items())]

    def in_catalog(self) -> list[tuple[int, int]]:
        """The ranges of partitions no shard holds (the catalog's), in order."""
        free, start = [], 0
        for shard_range in self.ranges:
            if shard_range.first > start:
                free.append((start, shard_range.first - 1))
            start = shard_range.last + 1
        if start < PARTITION_COUNT:
            free.append((start, PARTITION_COUNT - 1))
        return free


def parse_partitions(text: str) -> tuple[int, int]:
    """``FIRST-LAST`` (``256-511``; ``7-7`` for one partition) as two ints; ShardMapError otherwise."""
    match = _RANGE.match(text)
    if match is None:
        raise ShardMapError(f"partitions {text!r}: must be FIRST-LAST, e.g. 512-1023")
    first, last = int(match[1]), int(match[2])
    check_range(first, last)
    return first, last


def check_range(first: int, last: int) -> None:
    if not 0 <= first <= last < PARTITION_COUNT:
        raise ShardMapError(f"partitions {first}-{last}: must lie within 0-{PARTITION_COUNT - 1}, "
                            "the first not after the last")


def without_password(url: str) -> str:
    """``url`` as it may be shown: the password, if any, replaced by ``***``."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return urlunsplit(parts._replace(netloc=f"{userinfo.partition(':')[0]}:***@{hosts}"))


async def load_map(conn: db.Conn | asyncpg.Pool) -> ShardMap:
    """The map as the catalog holds it now; each shard's database is named "shard N" from then on, in
    the messages of this process."""
    head = db.one_row(await conn.fetchrow(sql("shard_map_head")))
    ranges = await _ranges(conn)
    for shard_range in ranges:
        db.name_database(shard_range.url, f"shard {shard_range.shard_id}")
    return ShardMap(head["version"], ranges)


async def shards_without_ranges(conn: db.Conn | asyncpg.Pool) -> list[tuple[int, str]]:
    """(id, URL) of each database registered as a shard that holds no range of the map: the target of
    a move before its cut-over (``chimes shards move --to URL`` registers it before it copies)."""
    return [(r["shard_id"], r["url"]) for r in await conn.fetch(sql("shards_without_ranges"))]


async def _ranges(conn: db.Conn | asyncpg.Pool) -> tuple[ShardRange, ...]:
    return tuple(ShardRange(r["first_partition"], r["last_partition"], r["shard_id"], r["url"], r["since_version"])
                 for r in await conn.fetch(sql("shard_map_ranges")))


def _overlapping(ranges: tuple[ShardRange, ...], first: int, last: int) -> list[ShardRange]:
    return [r for r in ranges if r.first <= last and first <= r.last]


async def partitions_holding_jobs(conn: asyncpg.Connection, first: int, last: int) -> list[int]:
    """The partitions ``first``-``last`` that hold a job or a trigger in the database of ``conn``."""
    found = {r["partition_id"] for r in await conn.fetch(sql("partitions_with_triggers"), first, last)}
    async with conn.transaction(readonly=True):
        async for record in conn.cursor(sql("all_job_ids"), prefetch=_JOB_ID_BATCH):
            partition = partition_of(record["job_id"])
            if first <= partition <= last:
                found.add(partition)
    return sorted(found)


def _describe_partitions(partitions: list[int]) -> str:
    shown = ", ".join(map(str, partitions[:10]))
    return shown + (f" and {len(partitions) - 10} more" if len(partitions) > 10 else "")


async def check_new_shard(catalog: asyncpg.Connection, url: str) -> None:
    """Refuse a database that is the catalog, or that holds jobs already; write nothing to it."""
    key = secrets.randbits(62)  # advisory lock keys are bigints; this one is the catalog's mark

    async def probe(conn: asyncpg.Connection) -> None:
        found = db.one_row(await conn.fetchrow(sql("shard_probe"), key))
        if found["is_catalog"]:
            raise ShardMapError("that URL is the catalog database itself: a shard must be another database")
        if found["has_jobs"] and await conn.fetchval(sql("any_job")):
            raise ShardMapError("that database holds jobs already: a new shard must start empty")

    await catalog.execute(sql("hold_probe_lock"), key)
    try:
        await db.with_connection(url, probe)
    finally:
        await catalog.execute(sql("release_probe_lock"), key)


async def add_shard(catalog: asyncpg.Connection, url: str, first: int, last: int) -> ShardMap:
    """Give partitions ``first``-``last`` to the database at ``url``, migrating it first; the new map.

    The new database gets the catalog's operator settings (:func:`copy_settings`) before its range.

    Refused with :class:`ShardMapError`, before anything is written anywhere, when the range is
    malformed or overlaps a shard's range, when the database is the catalog or holds jobs, or when
    any of the partitions holds a job where it lives now (the catalog): :mod:`chimes.moves`
    moves those. The fleet may run meanwhile: a job created in the
    catalog while the map changes is found before the commit (refused then), and the catalog
    refuses the range's new jobs after it (the fence), until every router has reloaded the map.
    """
    check_range(first, last)
    if not url.strip():
        raise ShardMapError("the shard's URL is empty")
    current = await load_map(catalog)
    _refuse_overlap(current.ranges, first, last)
    horizon = await catalog.fetchval(sql("snapshot_horizon"))  # before the scan's snapshot
    _refuse_busy(await partitions_holding_jobs(catalog, first, last))
    await check_new_shard(catalog, url)
    await db.with_connection(url, migrate)
    await copy_settings(catalog, url)
    return await give_range(catalog, url, first, last, horizon)


async def give_range(catalog: asyncpg.Connection, url: str, first: int, last: int, horizon: int) -> ShardMap:
    """The last step of :func:`add_shard`, in one transaction of the catalog: the fence, the jobs
    written since ``horizon`` (a ``snapshot_horizon`` read before the scan for jobs), the map."""
    async with catalog.transaction():
        await catalog.execute(sql("lock_shard_map"))
        # The fence: from this commit on the catalog refuses new jobs in the range (a router that has
        # not reloaded the map yet reloads it and goes to the shard). The creates the scan above could
        # not see have committed once the lock is ours: they are read again, here.
        await catalog.execute(sql("lock_catalog_jobs"))
        await catalog.execute(sql("create_catalog_fence"))
        _refuse_overlap(await _ranges(catalog), first, last)  # a change that committed meanwhile
        written = await catalog.fetch(sql("jobs_written_since"), horizon)
        _refuse_busy(sorted({p for p in (partition_of(r["job_id"]) for r in written) if first <= p <= last}))
        shard_id = await catalog.fetchval(sql("add_shard"), url)
        version = await catalog.fetchval(sql("raise_shard_map_version"))
        await catalog.execute(sql("add_shard_range"), first, last, shard_id, version)
    return await load_map(catalog)


def _refuse_busy(busy: list[int]) -> None:
    if busy:
        raise ShardMapError(f"partitions {_describe_partitions(busy)} hold jobs in the catalog database: "
                            "`chimes shards move FIRST-LAST --to URL` moves partitions with their jobs")


async def copy_settings(catalog: asyncpg.Connection, url: str) -> None:
    """Give the database at ``url`` the catalog's operator settings (``chimes config``): each home's
    statements read their own database's copy (the default failure webhook is read where a
    notification is queued, docs/scaling.md). Safe to repeat."""
    rows = await catalog.fetch(sql("all_settings"))

    async def write(conn: asyncpg.Connection) -> None:
        async with conn.transaction():
            await conn.execute("DELETE FROM settings")  # a shard keeps no setting of its own
            await conn.executemany(sql("set_setting"), [(r["key"], r["value"]) for r in rows])

    await db.with_connection(url, write)


def _refuse_overlap(ranges: tuple[ShardRange, ...], first: int, last: int) -> None:
    overlap = _overlapping(ranges, first, last)
    if overlap:
        held = ", ".join(f"{r.first}-{r.last} (shard {r.shard_id})" for r in overlap)
        raise ShardMapError(f"partitions {first}-{last} overlap {held}: a partition has one home")


class ShardPools:
    """The pools of one process: the catalog's, given, and one per shard of ``shard_map``, opened when
    a partition of that shard is first asked for, with at most ``max_size`` connections each. The
    catalog's pool is the caller's to close; :meth:`close` closes the shards'."""

    def __init__(self, catalog: asyncpg.Pool, shard_map: ShardMap, *, max_size: int = 10,
                 command_timeout: float | None = None, connect_wait_sec: float | None = None) -> None:
        self.catalog = catalog
        self.map = shard_map
        self._max_size = max_size
        self._command_timeout = command_timeout
        self._connect_wait_sec = connect_wait_sec  # None: the process's --database-wait
        self._pools: dict[int, asyncpg.Pool] = {}
        self._opening: dict[int, asyncio.Lock] = {}

    async def for_partition(self, partition: int) -> asyncpg.Pool:
        shard_range = self.map.range_of(partition)
        if shard_range is None:
            return self.catalog
        pool = self._pools.get(shard_range.shard_id)
        if pool is not None:
            return pool
        lock = self._opening.setdefault(shard_range.shard_id, asyncio.Lock())
        async with lock:  # two first requests at once open one pool
            pool = self._pools.get(shard_range.shard_id)
            if pool is None:
                pool = await db.create_pool(shard_range.url, min_size=0, max_size=self._max_size,
                                            command_timeout=self._command_timeout, wait_sec=self._connect_wait_sec)
                self._pools[shard_range.shard_id] = pool
        return pool

    async def for_job(self, job_id: uuid.UUID) -> asyncpg.Pool:
        return await self.for_partition(partition_of(job_id))

    async def homes(self) -> list[asyncpg.Pool]:
        """The pool of every database that holds partitions: the catalog's first, then each shard's."""
        firsts = {r.shard_id: r.first for r in self.map.ranges}
        return [self.catalog, *[await self.for_partition(first) for first in firsts.values()]]

    async def refresh(self) -> bool:
        """Read the map's version from the catalog and, when it changed, the map itself; close the pools
        of shards it no longer names. True when the map changed. One primary-key read, cheap enough
        for a role's lease renewals (the roles read the map at start only, for now)."""
        version = await self.catalog.fetchval(sql("shard_map_version"))
        if version == self.map.version:
            return False
        self.map = await load_map(self.catalog)
        named = {r.shard_id for r in self.map.ranges}
        gone = [self._pools.pop(shard_id) for shard_id in list(self._pools) if shard_id not in named]
        await asyncio.gather(*(pool.close() for pool in gone))
        return True

    def opened(self) -> int:
        """How many shard pools are open (the catalog's not counted)."""
        return len(self._pools)

    async def close(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        await asyncio.gather(*(pool.close() for pool in pools))
