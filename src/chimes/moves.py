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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from chimes.ids import PARTITION_COUNT
from chimes.store import db
from chimes.store import moves as move_store
from chimes.store.migrate import migrate
from chimes.store.moves import MOVED_TABLES, Move, home_name, move_under_way
from chimes.store.shards import (
    ShardMap,
    ShardMapError,
    check_new_shard,
    check_range,
    copy_settings,
    load_map,
    without_password,
)
from chimes.store.upgrades import read_home_plan

log = logging.getLogger(__name__)

MOVES_RELEASE = "0.3.0"  # the first release whose job writes check the move's fence
STOP_POINTS = ("copying", "fenced", "drained", "copied", "cut_over", "cleaning")
# Partitions copied in one target transaction: all that differ. A job's partition is not indexed
# (nor a run's), so each batch is a scan of the source's table: one per table and pass.
PARTITIONS_PER_COPY = PARTITION_COUNT
SMALL_PASS_ROWS = 2_000  # a copy pass this small is the last before the fence
MAX_ONLINE_PASSES = 6
MAX_FENCED_PASSES = 5
POLL_SEC = 0.05
MOVER_HEARTBEAT_SEC = 2.0  # how often a mover writes its heartbeat, on a catalog connection of its own


class MoveError(ShardMapError):
    """A move refused or stopped; the message says why and what state it left."""


def source_of(shard_map: ShardMap, first: int, last: int) -> int | None:
    """The home holding every partition of ``first``-``last`` (a shard id; None: the catalog);
    MoveError when the range spans homes."""
    homes = {getattr(shard_map.range_of(p), "shard_id", None) for p in range(first, last + 1)}
    if len(homes) > 1:
        held = ", ".join(sorted(home_name(h) for h in homes))
        raise MoveError(f"partitions {first}-{last} live in several homes ({held}): move one home's part at a time")
    return homes.pop()


@dataclass(frozen=True, slots=True)
class Homes:
    catalog_url: str
    source_url: str
    target_url: str


async def _home_url(catalog: db.Connection, catalog_url: str, shard_id: int | None) -> str:
    if shard_id is None:
        return catalog_url
    url = await move_store.shard_url(catalog, shard_id)
    if url is None:
        raise MoveError(f"there is no shard {shard_id} (chimes shards list)")
    return url


async def homes_of(catalog: db.Connection, catalog_url: str, move: Move) -> Homes:
    return Homes(catalog_url, await _home_url(catalog, catalog_url, move.source_shard),
                 await _home_url(catalog, catalog_url, move.target_shard))


async def resolve_target(catalog: db.Connection, target: str) -> tuple[int | None, str | None]:
    """``--to``: "catalog", a shard's id, or the URL of a database (a shard already, or a new one):
    the shard id (None: the catalog) and, for a database not in the map yet, its URL."""
    text = target.strip()
    if text.lower() == "catalog":
        return None, None
    if text.isdigit():
        if await move_store.shard_url(catalog, int(text)) is None:
            raise MoveError(f"there is no shard {text} (chimes shards list)")
        return int(text), None
    if "://" not in text:
        raise MoveError(f"--to {target!r}: must be 'catalog', a shard's id, or a PostgreSQL URL")
    known = await move_store.shard_by_url(catalog, text)
    return (known, None) if known is not None else (None, text)


async def _refuse_old_processes(urls: Sequence[str]) -> None:
    """Every live process of every home must check the move's fence (release >= MOVES_RELEASE)."""
    old: list[str] = []
    for url in dict.fromkeys(urls):
        plan = await db.with_connection(url, lambda conn: read_home_plan(conn, "home"))
        old += [str(p) for p in plan.live if p.predates(MOVES_RELEASE)]
    if old:
        raise MoveError(f"moves need every process at release {MOVES_RELEASE} or later; still live: "
                        f"{', '.join(old[:5])}{' and more' if len(old) > 5 else ''}")


async def begin_move(catalog: db.Connection, catalog_url: str, first: int, last: int, target: str,
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
    counts = await db.with_connection(source_url, lambda conn: move_store.row_counts(conn, first, last))
    target_label = without_password(new_url) if new_url else home_name(target_shard)
    plan = (f"partitions {first}-{last}: {home_name(source)} -> {target_label}; "
            f"{counts['jobs']:,} jobs, {counts['triggers']:,} triggers, {counts['runs']:,} runs to copy")
    if dry_run:
        return None, plan
    if new_url is not None:
        await copy_settings(catalog, new_url)
        target_shard = await move_store.register_shard(catalog, new_url)
    move = await move_store.insert_move(catalog, first, last, source, target_shard, _mover_name())
    if move is None:
        raise MoveError("another move began meanwhile: resume or cancel it first")
    return move, plan


def _mover_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


async def lock_mover(catalog: db.Connection) -> None:
    """Hold the one-mover lock on ``catalog`` until it closes; MoveError if another mover holds it."""
    if not await move_store.lock_mover(catalog):
        raise MoveError("another `chimes shards move` is running: wait for it, or stop it first")


Report = Callable[[Move], None]
# Called as the mover passes each of STOP_POINTS, with the move as recorded there: tests hold a mover
# at a point to kill it, or to act on the range while it waits there.
StopHook = Callable[[Move, str], Awaitable[None]]


def hold_at(point: str, say: Callable[[str], None] | None = None) -> StopHook:
    """A stop hook that holds the mover at ``point`` until its task is cancelled or its process is
    killed; ``say`` (stdout by default) announces it."""

    async def hold(move: Move, reached: str) -> None:
        if reached == point:
            line = f"move {move.move_id}: stopped at {point}"
            if say is None:
                print(line, flush=True)  # a test reading the mover's output waits for this line
            else:
                say(line)
            await asyncio.Event().wait()

    return hold


class Mover:
    """Takes a recorded move through its remaining phases (:func:`begin_move` records one)."""

    def __init__(self, catalog: db.Connection, homes: Homes, move: Move, *, report: Report,
                 drain_timeout_sec: float = 60.0, stop_at: StopHook | None = None) -> None:
        self._catalog = catalog
        self._homes = homes
        self.move = move
        self._report = report
        self._drain_timeout_sec = drain_timeout_sec
        self._stop_at = stop_at
        self._source: db.Connection | None = None
        self._target: db.Connection | None = None

    async def run(self) -> Move:
        await self.connect()
        beating = asyncio.create_task(self._heartbeat())
        try:
            if self.move.phase == "copying":
                await self._copy_online()
                await self._record(await move_store.move_fenced(self._catalog, self.move.move_id,
                                                                "waiting for the range's runs in flight"))
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
        conn: db.Connection | None = None
        try:
            while True:
                try:
                    if conn is None or conn.is_closed():
                        conn = await db.connect(self._homes.catalog_url, wait_sec=0)
                    await move_store.heartbeat(conn, self.move.move_id, _mover_name())
                except db.DB_ERRORS as exc:
                    log.warning("move %d: the mover's heartbeat failed: %s", self.move.move_id, db.describe(exc))
                await asyncio.sleep(MOVER_HEARTBEAT_SEC)
        finally:
            if conn is not None and not conn.is_closed():
                conn.terminate()

    # --- phase 1: copying -----------------------------------------------------------------------

    async def _copy_online(self) -> None:
        target, move = self._dst, self.move
        await move_store.create_moved_fence(target)
        await move_store.close_partitions(target, move.first, move.last, move.move_id)
        if not await move_store.any_copies(target, move.move_id):
            await move_store.delete_range(target, move.first, move.last)  # left by an earlier move that was cancelled
        await move_store.same_run_days(self._src, target)
        before = None
        for _ in range(MAX_ONLINE_PASSES):
            copied, _ = await self._pass()
            await self._stop_if("copying")
            # Small enough, or no longer shrinking: the partitions that change every second (a busy
            # job's trigger and runs) are copied again by every pass, whatever it follows.
            if copied <= SMALL_PASS_ROWS or (before is not None and copied > before * 0.8):
                break
            before = copied

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
            wanted = await move_store.fingerprints(self._src, table, move.first, move.last)
            held = await move_store.copied_fingerprints(self._dst, move.move_id, table.name)
            differ = [p for p in range(move.first, move.last + 1)
                      if (wanted[p][0] if p in wanted else None) != held.get(p)]
            plans.append((table, wanted, differ))
        left = sum(wanted[p][1] for _, wanted, differ in plans for p in differ if p in wanted)
        for table, wanted, differ in plans:
            for at in range(0, len(differ), PARTITIONS_PER_COPY):
                batch = differ[at:at + PARTITIONS_PER_COPY]
                rows = await move_store.copy_partitions(self._src, self._dst, move.move_id, table, batch, wanted)
                copied, left = copied + rows, max(0, left - rows)
                elapsed = max(time.monotonic() - started, 1e-6)
                await self._progress(move.rows_copied + copied, copied / elapsed if copied else None, left)
        await self._progress(move.rows_copied + copied, self.move.rows_per_sec, 0, passes=move.passes + 1)
        return copied, sum(len(differ) for _, _, differ in plans)

    # --- phase 2: fenced --------------------------------------------------------------------------

    async def _fence_and_drain(self) -> bool:
        """Fence the source, wait for the range to come to rest there, copy what is left. False: the
        range's runs did not end within the drain timeout, and the move was cancelled."""
        move, source = self.move, self._src
        async with source.transaction():
            await move_store.close_partitions(source, move.first, move.last, move.move_id)
        await move_store.create_moved_fence(source)
        fenced = await move_store.database_now(source)
        self._report(self.move)
        await self._stop_if("fenced")
        deadline = time.monotonic() + self._drain_timeout_sec
        while (older := await move_store.older_transactions(source, fenced)) > 0:
            if time.monotonic() > deadline:
                await self.cancel(f"{older} transactions begun before the fence were still open after "
                                  f"{self._drain_timeout_sec:g} s")
                return False
            await asyncio.sleep(POLL_SEC)
        while True:
            running, queued = await move_store.range_in_flight(source, move.first, move.last)
            if running == 0 and queued == 0:
                break
            if time.monotonic() > deadline:
                await self.cancel(f"{running} runs of the range still ran and {queued} waited in the "
                                  f"queue after {self._drain_timeout_sec:g} s (--drain-timeout)")
                return False
            await asyncio.sleep(POLL_SEC)
        await move_store.hand_over_lost_runs(source, move.first, move.last)
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
            version = await move_store.reassign_range(catalog, move.first, move.last, move.target_shard)
            await self._record(await move_store.move_cut_over(catalog, move.move_id, version))
        self._report(self.move)
        await self._stop_if("cut_over")

    # --- phase 3: cut over ------------------------------------------------------------------------

    async def _finish(self) -> None:
        move = self.move
        await move_store.open_partitions(self._dst, move.first, move.last)
        # Neither finds anything when the copy is right: every run in flight was handed over, and the
        # source's queue of the range was empty. A run that escaped both would wait for ever here.
        # (After the opening: the scans of the target's runs stay out of the range's pause.)
        arrivals = ((move_store.lease_arrived_runs, "running without a lease; leased, expired, for its reaper"),
                    (move_store.queue_arrived_runs, "scheduled with nothing to start them; queued"))
        for arrive, what in arrivals:
            found = await arrive(self._dst, move.first, move.last)
            if found:
                log.warning("move %d: %d runs arrived on %s %s: %s", move.move_id, len(found), move.target, what,
                            ", ".join(str(run_id) for run_id in found[:10]))
        # The source keeps its lease rows closed: a router on the old map is refused there.
        await move_store.close_partitions(self._src, move.first, move.last, move.move_id)
        await move_store.delete_range(self._src, move.first, move.last, after_each=lambda: self._stop_if("cleaning"))
        await move_store.forget_move_copies(self._dst, move.move_id)
        await self._record(await move_store.move_ended(self._catalog, move.move_id, "done", None))
        self._report(self.move)

    async def cancel(self, why: str) -> Move:
        """Give the range back to the source before the cut-over: its lease rows open again, the
        target's copies go."""
        move = self.move
        if move.phase not in ("copying", "fenced"):
            raise MoveError(f"move {move.move_id} is {move.phase}: it can no longer be cancelled "
                            "(move the range back instead)")
        await move_store.open_partitions(self._src, move.first, move.last)
        await move_store.delete_range(self._dst, move.first, move.last)
        await move_store.forget_move_copies(self._dst, move.move_id)
        async with self._catalog.transaction():
            await self._record(await move_store.move_ended(self._catalog, move.move_id, "cancelled", why))
            if move.target_shard is not None:
                # A target registered by this move (--to URL) holds no range: it goes with the move, and the
                # map, which never named it, keeps its version. One that holds a range stays.
                forgotten = await move_store.forget_shard_without_ranges(self._catalog, move.target_shard)
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
    def _src(self) -> db.Connection:
        assert self._source is not None
        return self._source

    @property
    def _dst(self) -> db.Connection:
        assert self._target is not None
        return self._target

    async def _record(self, changed: Move | None) -> None:
        """Take the move as a statement that changed its row returned it; None: the row was no longer
        in the phase the statement expected."""
        if changed is None:
            phase = await move_store.move_phase(self._catalog, self.move.move_id) or "gone"
            raise MoveError(f"move {self.move.move_id} is {phase} now: another command changed it")
        self.move = changed

    async def _progress(self, rows_copied: int, rate: float | None, left: int, *, passes: int | None = None,
                        note: str | None = None) -> None:
        move = self.move
        await self._record(await move_store.move_progress(
            self._catalog, move.move_id, move.passes if passes is None else passes, rows_copied, rate, left,
            note or move.note, _mover_name()))
        if passes is not None:
            self._report(self.move)

    async def _stop_if(self, point: str) -> None:
        if self._stop_at is not None:
            await self._stop_at(self.move, point)


