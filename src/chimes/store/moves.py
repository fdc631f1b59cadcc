"""The catalog's record of partition moves (its ``shard_moves`` rows) and the statements a move runs
on the homes: what is copied, how a partition's rows are told apart from an earlier copy, the fences.
The workflow that takes a move through its phases is :mod:`chimes.moves`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime

import asyncpg

from chimes.store import db
from chimes.store.queries import sql
from chimes.store.shards import ShardRange, load_map
from chimes.store.working import ANY_OWNER

PHASES_UNDER_WAY = ("copying", "fenced", "cut_over")
MOVER_GONE_AFTER_SEC = 15.0  # a heartbeat this old: the mover is gone (killed, its host lost, or frozen)
UNKNOWN_COPY = "?"  # the fingerprint recorded for a copy whose source was empty when read: never a real one


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


async def row_counts(conn: asyncpg.Connection, first: int, last: int) -> dict[str, int]:
    counts = {}
    for table in MOVED_TABLES:
        if table.name in ("jobs", "triggers", "runs"):
            counts[table.name] = await conn.fetchval(
                f"SELECT count(*) FROM {table.source} WHERE {table.part} BETWEEN $1 AND $2", first, last)
    return counts


async def lock_mover(catalog: asyncpg.Connection) -> bool:
    """Take the one-mover lock, held until ``catalog`` closes; False: another mover holds it."""
    return bool(await catalog.fetchval(sql("lock_mover")))


async def shard_url(catalog: asyncpg.Connection, shard_id: int) -> str | None:
    url = await catalog.fetchval(sql("shard_url"), shard_id)
    return None if url is None else str(url)


async def shard_by_url(catalog: asyncpg.Connection, url: str) -> int | None:
    known = await catalog.fetchval(sql("shard_by_url"), url)
    return None if known is None else int(known)


async def register_shard(catalog: asyncpg.Connection, url: str) -> int:
    return int(await catalog.fetchval(sql("register_shard"), url))


async def forget_shard_without_ranges(catalog: asyncpg.Connection, shard_id: int) -> str | None:
    """Unregister ``shard_id`` if it holds no range of the map; its URL when it was."""
    url = await catalog.fetchval(sql("forget_shard_without_ranges"), shard_id)
    return None if url is None else str(url)


async def insert_move(catalog: asyncpg.Connection, first: int, last: int, source: int | None,
                      target: int | None, mover: str) -> Move | None:
    """Record a move in its first phase; None when another is under way (shard_moves_one_at_a_time)."""
    try:
        row = await catalog.fetchrow(sql("begin_move"), first, last, source, target, mover)
    except asyncpg.UniqueViolationError:
        return None
    return _move(db.one_row(row))


async def _changed(catalog: asyncpg.Connection, statement: str, *args: object) -> Move | None:
    row = await catalog.fetchrow(sql(statement), *args)
    return None if row is None else _move(row)


async def move_progress(catalog: asyncpg.Connection, move_id: int, passes: int, rows_copied: int,
                        rate: float | None, left: int, note: str | None, mover: str) -> Move | None:
    """The move's progress; None (each of these) when the move is no longer in the phase it was."""
    return await _changed(catalog, "move_progress", move_id, passes, rows_copied, rate, left, note, mover)


async def move_fenced(catalog: asyncpg.Connection, move_id: int, note: str) -> Move | None:
    return await _changed(catalog, "move_fenced", move_id, note)


async def move_ended(catalog: asyncpg.Connection, move_id: int, phase: str, note: str | None) -> Move | None:
    return await _changed(catalog, "move_ended", move_id, phase, note)


async def move_phase(catalog: asyncpg.Connection, move_id: int) -> str | None:
    """The phase of ``move_id``; None when it is gone."""
    row = await catalog.fetchrow(sql("a_move"), move_id)
    return None if row is None else str(row["phase"])


async def heartbeat(catalog: asyncpg.Connection, move_id: int, mover: str) -> None:
    await catalog.execute(sql("move_heartbeat"), move_id, mover)


async def reassign_range(catalog: asyncpg.Connection, first: int, last: int, target: int | None) -> int:
    """Give the range to ``target`` (None: the catalog) in a new version of the map, fenced; the version.
    In the caller's transaction, with the move's row."""
    await catalog.execute(sql("lock_shard_map"))
    shard_map = await load_map(catalog)
    version = int(await catalog.fetchval(sql("raise_shard_map_version")))
    replaced, pieces = reassign(shard_map.ranges, first, last, target, version)
    for old in replaced:
        await catalog.execute(sql("delete_shard_range"), old.first)
    for piece_first, piece_last, shard, since in pieces:
        await catalog.execute(sql("add_shard_range"), piece_first, piece_last, shard, since)
    if pieces or shard_map.ranges:
        await catalog.execute(sql("create_catalog_fence"))
    return version


async def move_cut_over(catalog: asyncpg.Connection, move_id: int, version: int) -> Move | None:
    return await _changed(catalog, "move_cut_over", move_id, version)


async def create_moved_fence(conn: asyncpg.Connection) -> None:
    await conn.execute(sql("create_moved_fence"))


async def close_partitions(conn: asyncpg.Connection, first: int, last: int, move_id: int) -> None:
    await conn.execute(sql("close_partitions"), first, last, move_id)


async def open_partitions(conn: asyncpg.Connection, first: int, last: int) -> None:
    await conn.execute(sql("open_partitions"), first, last)


async def any_copies(conn: asyncpg.Connection, move_id: int) -> bool:
    return bool(await conn.fetchval(sql("any_copies"), move_id))


async def forget_move_copies(conn: asyncpg.Connection, move_id: int) -> None:
    await conn.execute(sql("forget_move_copies"), move_id)


async def same_run_days(source: asyncpg.Connection, target: asyncpg.Connection) -> None:
    """The target gets the days of runs the source has (runs are stored by day)."""
    days = await source.fetchrow(sql("run_days"))
    if days is not None and days["first_day"] is not None:
        first_day: date = days["first_day"]
        await target.fetchval(sql("ensure_run_days"), first_day, (days["last_day"] - first_day).days + 1)


async def copied_fingerprints(conn: asyncpg.Connection, move_id: int, table: str) -> dict[int, str]:
    """The fingerprint the target recorded with its last copy of each partition of ``table``."""
    return {r["partition_id"]: r["fingerprint"] for r in await conn.fetch(sql("copied_fingerprints"), move_id, table)}


async def copy_partitions(source: asyncpg.Connection, target: asyncpg.Connection, move_id: int, table: MovedTable,
                          partitions: list[int], wanted: dict[int, tuple[str, int]]) -> int:
    """Replace the target's rows of ``partitions`` of ``table`` with the source's, and record their
    fingerprints, in one target transaction; the rows copied."""
    listed = ",".join(map(str, partitions))  # ints: COPY takes no parameters
    query = f"SELECT t.* FROM {table.source} WHERE {table.part} = ANY('{{{listed}}}'::integer[])"
    async with target.transaction():
        await target.execute("SET LOCAL chimes.moving = 'on'")
        await target.execute(table.delete, partitions)
        rows = await _pipe(source, target, query, table.name)
        present = [p for p in partitions if p in wanted]
        empty = [p for p in partitions if p not in wanted]
        # A partition empty on the source when its fingerprint was read may have got a row since,
        # and the copy took it: recorded as unknown, it differs from the source's next fingerprint,
        # empty or not, and is copied again. (Forgotten, it would equal an emptied source's, and
        # the row, gone there by then, would stay here.)
        arrived = [r["partition_id"] for r in await target.fetch(table.occupied, empty)] if empty else []
        if present or arrived:
            await target.execute(sql("record_copies"), move_id, table.name, present + arrived,
                                 [wanted[p][0] for p in present] + [UNKNOWN_COPY] * len(arrived),
                                 [wanted[p][1] for p in present] + [0] * len(arrived))
        if gone := [p for p in empty if p not in arrived]:
            await target.execute(sql("forget_copies"), move_id, table.name, gone)
    return rows


async def database_now(conn: asyncpg.Connection) -> datetime:
    now: datetime = await conn.fetchval(sql("database_now"))
    return now


async def older_transactions(conn: asyncpg.Connection, since: datetime) -> int:
    """Transactions of other sessions begun before ``since`` and still open."""
    return int(await conn.fetchval(sql("older_transactions"), since))


async def range_in_flight(conn: asyncpg.Connection, first: int, last: int) -> tuple[int, int]:
    """The range's runs in flight and its queue entries on a home: (running, queued)."""
    left = db.one_row(await conn.fetchrow(sql("range_in_flight"), first, last))
    return int(left["running"]), int(left["queued"])


async def hand_over_lost_runs(conn: asyncpg.Connection, first: int, last: int) -> None:
    await conn.execute(sql("hand_over_lost_runs"), first, last)


async def lease_arrived_runs(conn: asyncpg.Connection, first: int, last: int) -> list[object]:
    """The runs that arrived running with no lease, now leased, expired; their ids."""
    return [r["run_id"] for r in await conn.fetch(sql("lease_arrived_runs"), first, last)]


async def queue_arrived_runs(conn: asyncpg.Connection, first: int, last: int) -> list[object]:
    """The runs that arrived scheduled with nothing to start them, now queued (and announced); their ids."""
    found = [r["run_id"] for r in await conn.fetch(sql("queue_arrived_runs"), first, last)]
    if found:  # announced, as every queued run is (Claimer.poll_wait)
        await conn.execute(sql("notify_queue"), ANY_OWNER)
    return found

async def fingerprints(conn: asyncpg.Connection, table: MovedTable, first: int,
                        last: int) -> dict[int, tuple[str, int]]:
    """Per partition of the range: (fingerprint, row count). A row's version is where it is and which
    transaction wrote it: any insert, update or delete changes its partition's fingerprint."""
    rows = await conn.fetch(
        f"SELECT {table.part} AS partition_id, count(*) AS row_count, "
        f"sum(hashtextextended(t.tableoid::text || ':' || t.ctid::text || ':' || t.xmin::text, 0)::numeric)::text "
        f"AS fingerprint FROM {table.source} WHERE {table.part} BETWEEN $1 AND $2 GROUP BY 1", first, last)
    return {r["partition_id"]: (f"{r['row_count']}:{r['fingerprint']}", r["row_count"]) for r in rows}


async def delete_range(conn: asyncpg.Connection, first: int, last: int, *,
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
