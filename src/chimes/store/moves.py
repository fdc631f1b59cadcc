"""Moving a range of partitions from one home to another while the fleet runs (docs/scaling.md,
"Moving partitions").

A move goes through three phases, each recorded in the catalog's ``shard_moves`` row, so that a
mover that was killed resumes where it was (``chimes shards move --resume``):

1. **copying**: the target closes its lease rows of the range (no node of it fires what arrives),
   then copies the range's rows from the source, which serves them meanwhile, pass after pass. A
   pass compares each partition's fingerprint on the source (row count and a sum over each row's
   version: its location and the transaction that wrote it) with the fingerprint the target recorded
   when it last copied that partition, in the same transaction as the copy, and copies again, whole,
   only the partitions that differ. Passes repeat until one is small.
2. **fenced**: the source closes its lease rows of the range in one transaction (every fire and reap
   checks its lease row in the transaction of its write: from that commit on the source fires and
   reaps nothing of the range) and refuses the range's job writes (``chimes_refuse_moved``, SQLSTATE
   CH001: a router answers by reading the map again). The mover waits for the source's
   transactions that began before the fence, then for the range's runs in flight there to end and
   its queue to empty (the source's workers finish them). A run still running then (its worker gone,
   or frozen past its lease) is handed over under a new lease token, with an expired lease row for
   the target's reaper: its old worker's late writes are refused. Nothing of the range changes on
   the source after that, and passes make the target's copy exact, until one finds nothing
   different.
3. **cut_over**: in one catalog transaction the range is given to the target (a new map version);
   the target opens its lease rows, and its nodes take them within a lease round (and it leases,
   expired, any run that arrived running with no lease, and queues any that arrived scheduled with
   nothing to start it: none should). The source's copies are deleted: its lease
   rows stay closed, so a router still on the old map is refused there and retries on the target.

A move can be cancelled before the cut-over (``--cancel``, or when the range's runs do not end within
the drain timeout): the source opens its lease rows again and the target's copies are deleted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime

import asyncpg

from chimes.ids import PARTITION_COUNT
from chimes.store import db
from chimes.store.migrate import migrate
from chimes.store.queries import sql
from chimes.store.shards import (
    ShardMap,
    ShardMapError,
    ShardRange,
    check_new_shard,
    check_range,
    copy_settings,
    load_map,
    without_password,
)
from chimes.store.upgrades import read_home_plan
from chimes.store.working import ANY_OWNER

log = logging.getLogger(__name__)

MOVES_RELEASE = "0.3.0"  # the first release whose job writes check the move's fence
PHASES_UNDER_WAY = ("copying", "fenced", "cut_over")
STOP_AT_ENV = "CHIMES_MOVE_STOP_AT"  # tests: the mover stops (and waits to be killed) at this point
STOP_POINTS = ("copying", "fenced", "drained", "copied", "cut_over", "cleaning")
# Partitions copied in one target transaction: all that differ. A job's partition is not indexed
# (nor a run's), so each batch is a scan of the source's table: one per table and pass.
PARTITIONS_PER_COPY = PARTITION_COUNT
SMALL_PASS_ROWS = 2_000  # a copy pass this small is the last before the fence
MAX_ONLINE_PASSES = 6
MAX_FENCED_PASSES = 5
POLL_SEC = 0.05
MOVER_HEARTBEAT_SEC = 2.0  # how often a mover writes its heartbeat, on a catalog connection of its own
MOVER_GONE_AFTER_SEC = 15.0  # a heartbeat this old: the mover is gone (killed, its host lost, or frozen)
UNKNOWN_COPY = "?"  # the fingerprint recorded for a copy whose source was empty when read: never a real one


class MoveError(ShardMapError):
    """A move refused or stopped; the message says why and what state it left."""


@dataclass(frozen=True, slots=True)
class MovedTable:
    """A table whose rows of the range move: ``source`` is its FROM clause (alias ``t``), ``part`` the
    partition of a row, ``delete`` the target's statement that removes a set of partitions ($1)."""

    name: str
    source: str
    part: str
    delete: str

    @property
    def occupied(self) -> str:
        """Which of a set of partitions ($1) hold rows of the table."""
        return f"SELECT DISTINCT {self.part} AS partition_id FROM {self.source} WHERE {self.part} = ANY($1::integer[])"


def _table(name: str, part: str) -> MovedTable:
    return MovedTable(name, f"{name} t", part, f"DELETE FROM {name} t WHERE {part} = ANY($1::integer[])")


_OF_JOB = "chimes_partition_of(t.job_id)"
# In the order of the copy: a run's attempts after the run (their partition is the run's).
MOVED_TABLES: tuple[MovedTable, ...] = (
    _table("jobs", _OF_JOB),
    _table("triggers", "t.partition_id"),
    _table("job_slot_counts", _OF_JOB),
    _table("job_pauses", _OF_JOB),
    _table("active_runs", _OF_JOB),
    _table("runs", "t.partition_id"),
    MovedTable("run_attempts",
               "run_attempts t JOIN runs r ON r.run_id = t.run_id AND r.scheduled_at = t.scheduled_at",
               "r.partition_id",
               "DELETE FROM run_attempts t USING runs r WHERE r.run_id = t.run_id AND r.scheduled_at = t.scheduled_at"
               " AND r.partition_id = ANY($1::integer[])"),
    _table("run_leases", "t.partition_id"),
    _table("audit_log", _OF_JOB),
)


@dataclass(frozen=True, slots=True)
class Move:
    move_id: int
    first: int
    last: int
    source_shard: int | None  # None: the catalog
    target_shard: int | None
    phase: str
    passes: int
    rows_copied: int
    rows_per_sec: float | None
    rows_left: int | None
    note: str | None
    mover: str | None
    heartbeat_at: datetime | None
    started_at: datetime
    fenced_at: datetime | None
    cut_over_at: datetime | None
    cut_over_version: int | None
    finished_at: datetime | None
    read_at: datetime | None = None  # the catalog's clock when the row was read

    @property
    def under_way(self) -> bool:
        return self.phase in PHASES_UNDER_WAY

    @property
    def heartbeat_age_sec(self) -> float | None:
        """How old the mover's heartbeat was when the row was read."""
        if self.heartbeat_at is None or self.read_at is None:
            return None
        return max(0.0, (self.read_at - self.heartbeat_at).total_seconds())

    @property
    def fenced_sec(self) -> float | None:
        """How long the range has fired nowhere, for a move under way past its fence: from the fence to
        the target opening its lease rows at the end of the move."""
        if self.phase not in ("fenced", "cut_over") or self.fenced_at is None or self.read_at is None:
            return None
        return max(0.0, (self.read_at - self.fenced_at).total_seconds())

    @property
    def mover_gone(self) -> bool:
        """A move under way whose mover has not written its heartbeat for MOVER_GONE_AFTER_SEC."""
        age = self.heartbeat_age_sec
        return self.under_way and age is not None and age > MOVER_GONE_AFTER_SEC

    def liveness(self) -> str | None:
        """For a move under way: its mover and the age of its heartbeat; once it is gone, since when,
        and the command that goes on."""
        age = self.heartbeat_age_sec
        if not self.under_way or age is None or self.heartbeat_at is None:
            return None
        if not self.mover_gone:
            return f"mover {self.mover} alive, heartbeat {age:.0f} s ago"
        since = self.heartbeat_at.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        then = ("`chimes shards move --resume` takes it on, `--cancel` gives the range back"
                if self.phase != "cut_over" else "`chimes shards move --resume` finishes it (past its cut-over a "
                                                 "move cannot be cancelled)")
        return f"mover {self.mover} gone since {since} (no heartbeat for {age:.0f} s): {then}"

    @property
    def source(self) -> str:
        return home_name(self.source_shard)

    @property
    def target(self) -> str:
        return home_name(self.target_shard)

    def seconds_left(self) -> float | None:
        if not self.rows_left or not self.rows_per_sec:
            return None
        return self.rows_left / self.rows_per_sec

    def describe(self, *, mover: bool = True) -> str:
        """One line: what moves where, its phase and progress, and (``mover``) whether its mover is alive."""
        line = f"move {self.move_id}: partitions {self.first}-{self.last} {self.source} -> {self.target}, {self.phase}"
        fenced = self.fenced_sec
        if fenced is not None:
            line += f"{' for' if self.phase == 'fenced' else ', fenced for'} {fenced:,.0f} s"
        if self.phase == "copying" or self.rows_copied:
            line += f", {self.rows_copied:,} rows copied in {self.passes} pass{'' if self.passes == 1 else 'es'}"
        if self.under_way and self.rows_per_sec:
            line += f", {self.rows_per_sec:,.0f} rows/s"
            left = self.seconds_left()
            if left is not None:
                line += f", about {left:,.0f} s left"
        if self.note:
            line += f" (when its mover stopped: {self.note})" if self.mover_gone else f" ({self.note})"
        liveness = self.liveness() if mover else None
        if liveness is not None:
            line += f"; {liveness}"
        return line


def home_name(shard_id: int | None) -> str:
    return "catalog" if shard_id is None else f"shard {shard_id}"


def _move(row: asyncpg.Record) -> Move:
    return Move(move_id=row["move_id"], first=row["first_partition"], last=row["last_partition"],
                source_shard=row["source_shard"], target_shard=row["target_shard"], phase=row["phase"],
                passes=row["passes"], rows_copied=row["rows_copied"], rows_per_sec=row["rows_per_sec"],
                rows_left=row["rows_left"], note=row["note"], mover=row["mover"], heartbeat_at=row["heartbeat_at"],
                started_at=row["started_at"], fenced_at=row["fenced_at"], cut_over_at=row["cut_over_at"],
                cut_over_version=row["cut_over_version"], finished_at=row["finished_at"], read_at=row["read_at"])


async def recent_moves(catalog: db.Conn | asyncpg.Pool, limit: int = 5) -> list[Move]:
    """The move under way first, if any, then the last ones that ended."""
    return [_move(r) for r in await catalog.fetch(sql("recent_moves"), limit)]


async def move_under_way(catalog: db.Conn | asyncpg.Pool) -> Move | None:
    row = await catalog.fetchrow(sql("move_under_way"))
    return None if row is None else _move(row)


def source_of(shard_map: ShardMap, first: int, last: int) -> int | None:
    """The home holding every partition of ``first``-``last`` (a shard id; None: the catalog);
    MoveError when the range spans homes."""
    homes = {getattr(shard_map.range_of(p), "shard_id", None) for p in range(first, last + 1)}
    if len(homes) > 1:
        held = ", ".join(sorted(home_name(h) for h in homes))
        raise MoveError(f"partitions {first}-{last} live in several homes ({held}): move one home's part at a time")
    return homes.pop()


def reassign(ranges: Sequence[ShardRange], first: int, last: int, target: int | None,
             version: int) -> tuple[list[ShardRange], list[tuple[int, int, int, int]]]:
    """The shard ranges that overlap ``first``-``last``, and the rows (first, last, shard, since
    version) that replace them: their parts outside the range, as they were, and the range itself,
    since ``version``, when the target is a shard."""
    overlapping = [r for r in ranges if r.first <= last and first <= r.last]
    pieces = [(r.first, first - 1, r.shard_id, r.since_version) for r in overlapping if r.first < first]
    pieces += [(last + 1, r.last, r.shard_id, r.since_version) for r in overlapping if r.last > last]
    if target is not None:
        pieces.append((first, last, target, version))
    return overlapping, sorted(pieces)


@dataclass(frozen=True, slots=True)
class Homes:
    catalog_url: str
    source_url: str
    target_url: str


async def _home_url(catalog: asyncpg.Connection, catalog_url: str, shard_id: int | None) -> str:
    if shard_id is None:
        return catalog_url
    url = await catalog.fetchval(sql("shard_url"), shard_id)
    if url is None:
        raise MoveError(f"there is no shard {shard_id} (chimes shards list)")
    return str(url)


async def homes_of(catalog: asyncpg.Connection, catalog_url: str, move: Move) -> Homes:
    return Homes(catalog_url, await _home_url(catalog, catalog_url, move.source_shard),
                 await _home_url(catalog, catalog_url, move.target_shard))


async def resolve_target(catalog: asyncpg.Connection, target: str) -> tuple[int | None, str | None]:
    """``--to``: "catalog", a shard's id, or the URL of a database (a shard already, or a new one):
    the shard id (None: the catalog) and, for a database not in the map yet, its URL."""
    text = target.strip()
    if text.lower() == "catalog":
        return None, None
    if text.isdigit():
        if await catalog.fetchval(sql("shard_url"), int(text)) is None:
            raise MoveError(f"there is no shard {text} (chimes shards list)")
        return int(text), None
    if "://" not in text:
        raise MoveError(f"--to {target!r}: must be 'catalog', a shard's id, or a PostgreSQL URL")
    known = await catalog.fetchval(sql("shard_by_url"), text)
    return (int(known), None) if known is not None else (None, text)


async def _refuse_old_processes(urls: Sequence[str]) -> None:
    """Every live process of every home must check the move's fence (release >= MOVES_RELEASE)."""
    old: list[str] = []
    for url in dict.fromkeys(urls):
        plan = await db.with_connection(url, lambda conn: read_home_plan(conn, "home"))
        old += [str(p) for p in plan.live if p.predates(MOVES_RELEASE)]
    if old:
        raise MoveError(f"moves need every process at release {MOVES_RELEASE} or later; still live: "
                        f"{', '.join(old[:5])}{' and more' if len(old) > 5 else ''}")


async def begin_move(catalog: asyncpg.Connection, catalog_url: str, first: int, last: int, target: str,
                     *, dry_run: bool = False) -> tuple[Move | None, str]:
    """Check and record a move of ``first``-``last`` to ``target``; nothing is copied yet. Refused with
    MoveError, with nothing changed, when the range spans homes, is where it would go, another move
    is under way, or a live process predates moves. With ``dry_run``, the plan alone (no row).
    Returns the move (None on a dry run) and a line that describes it."""
    check_range(first, last)
    under_way = await move_under_way(catalog)
    if under_way is not None:
        raise MoveError(f"another move is under way ({under_way.describe()}): resume or cancel it first")
    shard_map = await load_map(catalog)
    source = source_of(shard_map, first, last)
    target_shard, new_url = await resolve_target(catalog, target)
    if new_url is None and target_shard == source:
        raise MoveError(f"partitions {first}-{last} live in {home_name(source)} already")
    source_url = await _home_url(catalog, catalog_url, source)
    target_url = new_url or await _home_url(catalog, catalog_url, target_shard)
    if new_url is not None:
        await check_new_shard(catalog, new_url)
    if not dry_run:  # a dry run leaves a new database as it found it
        await db.with_connection(target_url, migrate)
    await _refuse_old_processes([catalog_url, source_url, *([] if new_url else [target_url]), *shard_map.urls()])
    counts = await db.with_connection(source_url, lambda conn: _row_counts(conn, first, last))
    target_label = without_password(new_url) if new_url else home_name(target_shard)
    plan = (f"partitions {first}-{last}: {home_name(source)} -> {target_label}; "
            f"{counts['jobs']:,} jobs, {counts['triggers']:,} triggers, {counts['runs']:,} runs to copy")
    if dry_run:
        return None, plan
    if new_url is not None:
        await copy_settings(catalog, new_url)
        target_shard = await catalog.fetchval(sql("register_shard"), new_url)
    try:
        row = await catalog.fetchrow(sql("begin_move"), first, last, source, target_shard, _mover_name())
    except asyncpg.UniqueViolationError:  # shard_moves_one_at_a_time: another began meanwhile
        raise MoveError("another move began meanwhile: resume or cancel it first") from None
    return _move(db.one_row(row)), plan


async def _row_counts(conn: asyncpg.Connection, first: int, last: int) -> dict[str, int]:
    counts = {}
    for table in MOVED_TABLES:
        if table.name in ("jobs", "triggers", "runs"):
            counts[table.name] = await conn.fetchval(
                f"SELECT count(*) FROM {table.source} WHERE {table.part} BETWEEN $1 AND $2", first, last)
    return counts


def _mover_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


async def lock_mover(catalog: asyncpg.Connection) -> None:
    """Hold the one-mover lock on ``catalog`` until it closes; MoveError if another mover holds it."""
    if not await catalog.fetchval(sql("lock_mover")):
        raise MoveError("another `chimes shards move` is running: wait for it, or stop it first")


Report = Callable[[Move], None]


class Mover:
    """Takes a recorded move through its remaining phases (:func:`begin_move` records one)."""

    def __init__(self, catalog: asyncpg.Connection, homes: Homes, move: Move, *, report: Report,
                 drain_timeout_sec: float = 60.0, stop_at: str | None = None) -> None:
        self._catalog = catalog
        self._homes = homes
        self.move = move
        self._report = report
        self._drain_timeout_sec = drain_timeout_sec
        self._stop_at = stop_at if stop_at is not None else os.environ.get(STOP_AT_ENV) or None
        self._source: asyncpg.Connection | None = None
        self._target: asyncpg.Connection | None = None

    async def run(self) -> Move:
        await self.connect()
        beating = asyncio.create_task(self._heartbeat())
        try:
            if self.move.phase == "copying":
                await self._copy_online()
                await self._record(sql("move_fenced"), self.move.move_id, "waiting for the range's runs in flight")
            if self.move.phase == "fenced":
                if not await self._fence_and_drain():
                    return self.move
                await self._cut_over()
            if self.move.phase == "cut_over":
                await self._finish()
            return self.move
        finally:
            beating.cancel()
            await asyncio.gather(beating, return_exceptions=True)
            await self.close()

    async def _heartbeat(self) -> None:
        """Say the mover is alive every MOVER_HEARTBEAT_SEC, on a catalog connection of its own: the
        phases' work holds the mover's connections for as long as a copy or a drain takes. A failed
        beat is tried again at the next (the phase's own statements meet the same failure)."""
        conn: asyncpg.Connection | None = None
        try:
            while True:
                try:
                    if conn is None or conn.is_closed():
                        conn = await db.connect(self._homes.catalog_url, wait_sec=0)
                    await conn.execute(sql("move_heartbeat"), self.move.move_id, _mover_name())
                except db.DB_ERRORS as exc:
                    log.warning("move %d: the mover's heartbeat failed: %s", self.move.move_id, db.describe(exc))
                await asyncio.sleep(MOVER_HEARTBEAT_SEC)
        finally:
            if conn is not None and not conn.is_closed():
                conn.terminate()

    # --- phase 1: copying -----------------------------------------------------------------------

    async def _copy_online(self) -> None:
        target, move = self._dst, self.move
        await target.execute(sql("create_moved_fence"))
        await target.execute(sql("close_partitions"), move.first, move.last, move.move_id)
        if not await target.fetchval(sql("any_copies"), move.move_id):
            await _delete_range(target, move.first, move.last)  # left by an earlier move that was cancelled
        await self._same_run_days()
        before = None
        for _ in range(MAX_ONLINE_PASSES):
            copied, _ = await self._pass()
            await self._stop_if("copying")
            # Small enough, or no longer shrinking: the partitions that change every second (a busy
            # job's trigger and runs) are copied again by every pass, whatever it follows.
            if copied <= SMALL_PASS_ROWS or (before is not None and copied > before * 0.8):
                break
            before = copied

    async def _same_run_days(self) -> None:
        days = await self._src.fetchrow(sql("run_days"))
        if days is not None and days["first_day"] is not None:
            first_day: date = days["first_day"]
            await self._dst.fetchval(sql("ensure_run_days"), first_day, (days["last_day"] - first_day).days + 1)

    async def _pass(self) -> tuple[int, int]:
        """One pass over every table: the rows it copied, and the partitions (of every table) it
        found different and copied again. Each table's fingerprints are read before its rows are
        copied, in statements of their own (a snapshot held for a whole pass kept the fleet's busiest
        rows, the lease rows, from being vacuumed for its length): a copy can only be newer than the
        fingerprint recorded with it, which the next pass finds different. A pass can copy no row
        and still have changed the target (a partition emptied on the source meanwhile): only a pass
        that finds nothing different shows the copy exact."""
        move = self.move
        started, copied = time.monotonic(), 0
        plans = []
        for table in MOVED_TABLES:
            wanted = await _fingerprints(self._src, table, move.first, move.last)
            held = {r["partition_id"]: r["fingerprint"]
                    for r in await self._dst.fetch(sql("copied_fingerprints"), move.move_id, table.name)}
            differ = [p for p in range(move.first, move.last + 1)
                      if (wanted[p][0] if p in wanted else None) != held.get(p)]
            plans.append((table, wanted, differ))
        left = sum(wanted[p][1] for _, wanted, differ in plans for p in differ if p in wanted)
        for table, wanted, differ in plans:
            for at in range(0, len(differ), PARTITIONS_PER_COPY):
                batch = differ[at:at + PARTITIONS_PER_COPY]
                rows = await self._copy(table, batch, wanted)
                copied, left = copied + rows, max(0, left - rows)
                elapsed = max(time.monotonic() - started, 1e-6)
                await self._progress(move.rows_copied + copied, copied / elapsed if copied else None, left)
        await self._progress(move.rows_copied + copied, self.move.rows_per_sec, 0, passes=move.passes + 1)
        return copied, sum(len(differ) for _, _, differ in plans)

    async def _copy(self, table: MovedTable, partitions: list[int], wanted: dict[int, tuple[str, int]]) -> int:
        """Replace the target's rows of ``partitions`` of ``table`` with the source's, and record their
        fingerprints, in one target transaction; the rows copied."""
        listed = ",".join(map(str, partitions))  # ints: COPY takes no parameters
        query = f"SELECT t.* FROM {table.source} WHERE {table.part} = ANY('{{{listed}}}'::integer[])"
        async with self._dst.transaction():
            await self._dst.execute("SET LOCAL chimes.moving = 'on'")
            await self._dst.execute(table.delete, partitions)
            rows = await _pipe(self._src, self._dst, query, table.name)
            present = [p for p in partitions if p in wanted]
            empty = [p for p in partitions if p not in wanted]
            # A partition empty on the source when its fingerprint was read may have got a row since,
            # and the copy took it: recorded as unknown, it differs from the source's next fingerprint,
            # empty or not, and is copied again. (Forgotten, it would equal an emptied source's, and
            # the row, gone there by then, would stay here.)
            arrived = [r["partition_id"] for r in await self._dst.fetch(table.occupied, empty)] if empty else []
            if present or arrived:
                await self._dst.execute(sql("record_copies"), self.move.move_id, table.name, present + arrived,
                                        [wanted[p][0] for p in present] + [UNKNOWN_COPY] * len(arrived),
                                        [wanted[p][1] for p in present] + [0] * len(arrived))
            if gone := [p for p in empty if p not in arrived]:
                await self._dst.execute(sql("forget_copies"), self.move.move_id, table.name, gone)
        return rows

    # --- phase 2: fenced --------------------------------------------------------------------------

    async def _fence_and_drain(self) -> bool:
        """Fence the source, wait for the range to come to rest there, copy what is left. False: the
        range's runs did not end within the drain timeout, and the move was cancelled."""
        move, source = self.move, self._src
        async with source.transaction():
            await source.execute(sql("close_partitions"), move.first, move.last, move.move_id)
        await source.execute(sql("create_moved_fence"))
        fenced = await source.fetchval(sql("database_now"))
        self._report(self.move)
        await self._stop_if("fenced")
        deadline = time.monotonic() + self._drain_timeout_sec
        while (older := await source.fetchval(sql("older_transactions"), fenced)) > 0:
            if time.monotonic() > deadline:
                await self.cancel(f"{older} transactions begun before the fence were still open after "
                                  f"{self._drain_timeout_sec:g} s")
                return False
            await asyncio.sleep(POLL_SEC)
        while True:
            left = db.one_row(await source.fetchrow(sql("range_in_flight"), move.first, move.last))
            if left["running"] == 0 and left["queued"] == 0:
                break
            if time.monotonic() > deadline:
                await self.cancel(f"{left['running']} runs of the range still ran and {left['queued']} waited in the "
                                  f"queue after {self._drain_timeout_sec:g} s (--drain-timeout)")
                return False
            await asyncio.sleep(POLL_SEC)
        await source.execute(sql("hand_over_lost_runs"), move.first, move.last)
        await self._stop_if("drained")
        await self._progress(self.move.rows_copied, self.move.rows_per_sec, 0,
                             note="the range is at rest: copying what changed before the fence")
        # Nothing of the range changes on the source now but what its sweeps may still do (retention
        # dropping a day of history, say): passes until one finds nothing different.
        for _ in range(MAX_FENCED_PASSES):
            _, differed = await self._pass()
            if not differed:
                break
        else:
            raise MoveError(f"move {move.move_id}: the range kept changing on {move.source} after the fence; the "
                            "move stays fenced: find what writes there, then resume or cancel it")
        await self._stop_if("copied")
        return True

    async def _cut_over(self) -> None:
        move, catalog = self.move, self._catalog
        async with catalog.transaction():
            await catalog.execute(sql("lock_shard_map"))
            shard_map = await load_map(catalog)
            version = await catalog.fetchval(sql("raise_shard_map_version"))
            replaced, pieces = reassign(shard_map.ranges, move.first, move.last, move.target_shard, version)
            for old in replaced:
                await catalog.execute(sql("delete_shard_range"), old.first)
            for first, last, shard, since in pieces:
                await catalog.execute(sql("add_shard_range"), first, last, shard, since)
            if pieces or shard_map.ranges:
                await catalog.execute(sql("create_catalog_fence"))
            await self._record(sql("move_cut_over"), move.move_id, version)
        self._report(self.move)
        await self._stop_if("cut_over")

    # --- phase 3: cut over ------------------------------------------------------------------------

    async def _finish(self) -> None:
        move = self.move
        await self._dst.execute(sql("open_partitions"), move.first, move.last)
        # Neither finds anything when the copy is right: every run in flight was handed over, and the
        # source's queue of the range was empty. A run that escaped both would wait for ever here.
        # (After the opening: the scans of the target's runs stay out of the range's pause.)
        for statement, what in (("lease_arrived_runs", "running without a lease; leased, expired, for its reaper"),
                                ("queue_arrived_runs", "scheduled with nothing to start them; queued")):
            found = await self._dst.fetch(sql(statement), move.first, move.last)
            if found:
                log.warning("move %d: %d runs arrived on %s %s: %s", move.move_id, len(found), move.target, what,
                            ", ".join(str(r["run_id"]) for r in found[:10]))
                if statement == "queue_arrived_runs":  # announced, as every queued run is (Worker._poll_wait)
                    await self._dst.execute(sql("notify_queue"), ANY_OWNER)
        # The source keeps its lease rows closed: a router on the old map is refused there.
        await self._src.execute(sql("close_partitions"), move.first, move.last, move.move_id)
        await _delete_range(self._src, move.first, move.last, after_each=lambda: self._stop_if("cleaning"))
        await self._dst.execute(sql("forget_move_copies"), move.move_id)
        await self._record(sql("move_ended"), move.move_id, "done", None)
        self._report(self.move)

    async def cancel(self, why: str) -> Move:
        """Give the range back to the source before the cut-over: its lease rows open again, the
        target's copies go."""
        move = self.move
        if move.phase not in ("copying", "fenced"):
            raise MoveError(f"move {move.move_id} is {move.phase}: it can no longer be cancelled "
                            "(move the range back instead)")
        await self._src.execute(sql("open_partitions"), move.first, move.last)
        await _delete_range(self._dst, move.first, move.last)
        await self._dst.execute(sql("forget_move_copies"), move.move_id)
        async with self._catalog.transaction():
            await self._record(sql("move_ended"), move.move_id, "cancelled", why)
            if move.target_shard is not None:
                # A target registered by this move (--to URL) holds no range: it goes with the move, and the
                # map, which never named it, keeps its version. One that holds a range stays.
                forgotten = await self._catalog.fetchval(sql("forget_shard_without_ranges"), move.target_shard)
                if forgotten is not None:
                    log.info("move %d: shard %d (%s), which holds no range, is no longer registered", move.move_id,
                             move.target_shard, without_password(forgotten))
        self._report(self.move)
        return self.move

    async def connect(self) -> None:
        """Open the connections to the source and the target (:meth:`run` does; :meth:`cancel` needs it first)."""
        db.name_database(self._homes.source_url, f"the move's source, {self.move.source}")
        db.name_database(self._homes.target_url, f"the move's target, {self.move.target}")
        self._source = await db.connect(self._homes.source_url)
        self._target = await db.connect(self._homes.target_url)

    async def close(self) -> None:
        for conn in (self._source, self._target):
            if conn is not None and not conn.is_closed():
                await conn.close()

    # --- helpers -----------------------------------------------------------------------------------

    @property
    def _src(self) -> asyncpg.Connection:
        assert self._source is not None
        return self._source

    @property
    def _dst(self) -> asyncpg.Connection:
        assert self._target is not None
        return self._target

    async def _record(self, statement: str, *args: object) -> None:
        row = await self._catalog.fetchrow(statement, *args)
        if row is None:
            current = await self._catalog.fetchrow(sql("a_move"), self.move.move_id)
            phase = current["phase"] if current is not None else "gone"
            raise MoveError(f"move {self.move.move_id} is {phase} now: another command changed it")
        self.move = _move(row)

    async def _progress(self, rows_copied: int, rate: float | None, left: int, *, passes: int | None = None,
                        note: str | None = None) -> None:
        move = self.move
        await self._record(sql("move_progress"), move.move_id, move.passes if passes is None else passes,
                           rows_copied, rate, left, note or move.note, _mover_name())
        if passes is not None:
            self._report(self.move)

    async def _stop_if(self, point: str) -> None:
        if self._stop_at == point:
            print(f"move {self.move.move_id}: stopped at {point} ({STOP_AT_ENV})", flush=True)
            await asyncio.Event().wait()


async def _fingerprints(conn: asyncpg.Connection, table: MovedTable, first: int,
                        last: int) -> dict[int, tuple[str, int]]:
    """Per partition of the range: (fingerprint, row count). A row's version is where it is and which
    transaction wrote it: any insert, update or delete changes its partition's fingerprint."""
    rows = await conn.fetch(
        f"SELECT {table.part} AS partition_id, count(*) AS row_count, "
        f"sum(hashtextextended(t.tableoid::text || ':' || t.ctid::text || ':' || t.xmin::text, 0)::numeric)::text "
        f"AS fingerprint FROM {table.source} WHERE {table.part} BETWEEN $1 AND $2 GROUP BY 1", first, last)
    return {r["partition_id"]: (f"{r['row_count']}:{r['fingerprint']}", r["row_count"]) for r in rows}


async def _delete_range(conn: asyncpg.Connection, first: int, last: int, *,
                        after_each: Callable[[], object] | None = None) -> None:
    """Delete a home's rows of the range from every moved table, attempts before their runs."""
    partitions = list(range(first, last + 1))
    for table in sorted(MOVED_TABLES, key=lambda t: t.name != "run_attempts"):
        await conn.execute(table.delete, partitions)
        if after_each is not None:
            await after_each()  # type: ignore[misc]


async def _pipe(source: asyncpg.Connection, target: asyncpg.Connection, query: str, table: str) -> int:
    """COPY ``query``'s rows from ``source`` into ``table`` on ``target``, streamed in binary."""
    chunks: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=16)
    failed: list[BaseException] = []

    async def produce() -> None:
        try:
            await source.copy_from_query(query, output=chunks.put, format="binary")
        except BaseException as exc:
            failed.append(exc)
            raise
        finally:
            await chunks.put(None)

    async def consume() -> AsyncIterator[bytes]:
        while (chunk := await chunks.get()) is not None:
            yield chunk
        if failed:
            raise failed[0]

    producer = asyncio.create_task(produce())
    try:
        status = await target.copy_to_table(table, source=consume(), format="binary")
    except BaseException:
        producer.cancel()
        await asyncio.gather(producer, return_exceptions=True)
        raise
    await producer
    return int(status.split()[-1])
