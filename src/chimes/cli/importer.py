"""``chimes jobs import FILE.jsonl``: load a large set of schedules straight into the database.

Each line is a job exactly as ``POST /jobs`` takes it. Every line is validated by the same rules as
the API; the whole file loads in one transaction, so a bad line (reported with its number and
field) leaves the database as it was.

With shards (docs/scaling.md, "Shards"), each job goes to the database that holds its partition (the
catalog for partitions in no range), each database in a transaction of its own, all copied side by
side and committed only once every line is valid: a bad line still changes nothing anywhere. A
database that fails (unreachable, or lost midway) leaves the others to commit: the report names what
committed where and what failed, the lines not imported are written to a file of their own to import
again, and the exit status is 3 (1 when nothing was imported).

Validation is the cost (PostgreSQL's share of an import is about a fifth), so chunks of lines are
validated and turned into rows in several processes (``--processes``, one per core by default)
while this one feeds their rows, in file order, into the one COPY transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import os
import time
from array import array
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import click
from pydantic import ValidationError
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

from chimes.api.errors import field_path
from chimes.cli.options import database_options, settings_from
from chimes.cli.runtime import migrate_database
from chimes.cli.security_options import ImportKey
from chimes.ids import PARTITION_COUNT
from chimes.jobs import AtScheduleSpec, JobSpec
from chimes.security.secrets import Keyring, has_secrets, seal_spec
from chimes.services.admin import command_line_note
from chimes.services.jobs import UnknownCalendar, first_fire
from chimes.store import db
from chimes.store.audit import AuditNote, record
from chimes.store.bulk import Rows, copy_rows, job_rows
from chimes.store.calendars import missing_calendars
from chimes.store.shards import ShardMap, load_map, without_password

CHUNK = 5000
# Below this a file validates in about a second here, sooner than validating processes start: unless
# --processes says otherwise, it is validated in the importing process.
SMALL_FILE_BYTES = 4 * 2**20


class BadLine(click.ClickException):
    def __init__(self, number: int, message: str) -> None:
        super().__init__(f"line {number}: {message}; nothing was imported")


@dataclass(frozen=True, slots=True)
class Refused:
    """A bad line, returned rather than raised: it crosses from a validating process as a value."""

    number: int
    message: str


@dataclass(frozen=True, slots=True)
class Chunk:
    first_number: int  # of its first line in the file
    lines: list[bytes]
    end_offset: int  # in the file, after its last line (for the progress bar)
    id_millis: int  # the time in its job ids, later than the chunk before's: ids follow the file


def parse_line(line: bytes) -> JobSpec | str:
    """The job on one line, or what is wrong with it."""
    try:
        return JobSpec.model_validate_json(line)
    except ValidationError as exc:
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            return "not valid JSON"
        text = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        return f"{field_path(first.get('loc', ()))}: {text}"


def prepare(chunk: Chunk, owner: str, now: datetime, keyring: Keyring | None,
            numbered: bool = False) -> Rows | Refused | None:
    """The rows of a chunk, its first bad line, or None when it has secret values and no key was
    given yet (the caller loads the key and asks again). ``numbered``: each row keeps its line's
    number (with shards, for the file of the lines a shard did not take)."""
    specs, numbers = [], []
    calendars: dict[str, int] = {}
    for number, line in enumerate(chunk.lines, start=chunk.first_number):
        if not line.strip():
            continue
        spec = parse_line(line)
        if isinstance(spec, str):
            return Refused(number, spec)
        if not isinstance(spec.schedule, AtScheduleSpec):
            for name in spec.schedule.exclude_calendars or ():
                calendars.setdefault(name, number)
        if has_secrets(spec):
            if keyring is None:
                return None
            spec = seal_spec(spec, keyring)
        specs.append(spec)
        if numbered:
            numbers.append(number)
    return replace(job_rows(specs, owner, now, first_fire, chunk.id_millis, numbers), calendars=calendars)


def chunks(file: Path) -> Iterator[Chunk]:
    millis = 0

    def chunk(number: int, batch: list[bytes], offset: int) -> Chunk:
        nonlocal millis
        millis = max(int(time.time() * 1000), millis + 1)
        return Chunk(number, batch, offset, millis)

    with file.open("rb") as lines:
        number, batch = 1, []
        for line in lines:
            batch.append(line)
            if len(batch) == CHUNK:
                yield chunk(number, batch, lines.tell())
                number, batch = number + CHUNK, []
        if batch:
            yield chunk(number, batch, lines.tell())


Prepare = Callable[[Chunk, Keyring | None], Awaitable[Rows | Refused | None]]


@contextlib.asynccontextmanager
async def validators(processes: int, owner: str, now: datetime, *, numbered: bool = False) -> AsyncIterator[Prepare]:
    """``prepare`` in ``processes`` processes; in this one when 1. Each call starts the work at once
    (so several chunks are validated while this process copies) and returns an awaitable of it."""
    if processes <= 1:
        def here(chunk: Chunk, keyring: Keyring | None) -> Awaitable[Rows | Refused | None]:
            done = asyncio.get_running_loop().create_future()
            done.set_result(prepare(chunk, owner, now, keyring, numbered))
            return done

        yield here
        return
    loop = asyncio.get_running_loop()
    # spawn, not fork: this process holds a database connection and the progress bar's thread.
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                             initializer=gc.disable) as pool:
        try:
            yield lambda chunk, keyring: loop.run_in_executor(pool, prepare, chunk, owner, now, keyring, numbered)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # a bad line: the chunks after it are not needed


@click.command("import")
@database_options
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--owner", required=True, help="The team that will own the imported jobs.")
@click.option("--processes", type=click.IntRange(min=1), envvar="CHIMES_IMPORT_PROCESSES", show_envvar=True,
              default=lambda: os.cpu_count() or 1, show_default="one per core",
              help="Processes validating lines side by side (1: validate in this process).")
@click.option("--not-imported", "not_imported", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With shards: where to write the lines a database did not take "
                   "(default: FILE.not-imported.jsonl beside FILE).")
def import_jobs(database_url: str | None, data_dir: Path, file: Path, owner: str, processes: int,
                not_imported: Path | None) -> None:
    """Bulk-load jobs from a JSON Lines file (one POST /jobs body per line), all or nothing (with
    shards: all or nothing per database)."""
    source = click.get_current_context().get_parameter_source("processes")
    if source is click.core.ParameterSource.DEFAULT and file.stat().st_size < SMALL_FILE_BYTES:
        processes = 1
    with db.database_url(settings_from(database_url, data_dir)) as dsn, _without_cycle_collection():
        homes, seconds = asyncio.run(_import(dsn, file, file.stat().st_size, owner, data_dir, processes))
    count = sum(home.written for home in homes if home.committed)
    if all(home.committed for home in homes):
        click.echo(f"imported {count} jobs in {seconds:.1f}s ({count / max(seconds, 1e-9):,.0f} jobs/s)")
        if len(homes) > 1:
            click.echo("  " + "; ".join(f"{home.name}: {home.written} jobs" for home in homes))
        return
    if len(homes) == 1:
        raise click.ClickException(f"{homes[0].error}; " + ("the connection was lost while committing: the jobs "
                                                           "may or may not be there" if homes[0].committing
                                                           else "nothing was imported"))
    report = _report(homes, file, owner, not_imported or _beside(file))
    if not any(home.committed for home in homes):
        raise click.ClickException(report)
    raise PartlyImported(report)


class PartlyImported(click.ClickException):
    """Some databases took their share of the jobs, some did not: exit status 3."""

    exit_code = 3


@dataclass(eq=False)
class Home:
    """One database the import writes to (the catalog, or a shard), in a transaction of its own. A
    failure is kept, not raised: the other homes go on (docs/scaling.md, "Caps and quotas across
    shards")."""

    name: str
    url: str
    partitions: str  # the partitions it holds, as the report names them
    numbered: bool  # keep the line numbers of its jobs, for the file of lines not imported
    conn: db.Connection | None = None
    transaction: db.Transaction | None = None
    written: int = 0
    error: str | None = None
    committing: bool = False  # the error came while committing: the outcome is not known
    committed: bool = False
    numbers: array[int] = field(default_factory=lambda: array("L"))

    async def open(self, migrate_first: bool) -> None:
        try:
            if migrate_first:
                await migrate_database(self.url)
            self.conn = await db.connect(self.url)
            self.transaction = self.conn.transaction()
            await self.transaction.start()
        except (*db.DB_ERRORS, ValueError) as exc:
            self._fail(exc)

    async def copy(self, rows: Rows) -> None:
        if self.numbered:
            self.numbers.extend(rows.numbers)
        if self.error is not None or not rows.jobs:
            return
        assert self.conn is not None
        try:
            self.written += await copy_rows(self.conn, rows)
        except db.DB_ERRORS as exc:
            self._fail(exc)

    async def commit(self, note: AuditNote, file: Path, owner: str) -> None:
        """Commit what was copied, with one audit entry for this home's jobs (one a job would double
        what an import of millions writes)."""
        if self.error is not None:
            return
        assert self.transaction is not None and self.conn is not None
        try:
            if self.written:
                await record(self.conn, note, "job.import", f"import {file.name}", None,
                             {"owner": owner, "jobs": self.written, "file": str(file)}, subject_owner=owner)
            await self.transaction.commit()
        except db.DB_ERRORS as exc:
            # A refused commit (a PostgreSQL error) left nothing; a connection lost on the way may have
            # committed or not.
            self.committing = not isinstance(exc, db.DatabaseError)
            self._fail(exc)
        else:
            self.committed = True

    def _fail(self, exc: BaseException) -> None:
        self.error = db.describe(exc).splitlines()[0]  # PostgreSQL's DETAIL can hold a whole row
        self.close()

    def close(self) -> None:
        """Drop the connection: what it did not commit is rolled back by the server."""
        if self.conn is not None:
            self.conn.terminate()
            self.conn = None


@dataclass(eq=False)
class CalendarCheck:
    """The calendars the file's jobs name must be the owner's, as the API requires: checked in the
    catalog (in its transaction, which locks them until it commits, as a job written through the API
    does), each name once."""

    dsn: str
    catalog: Home
    owner: str
    known: set[str] = field(default_factory=set)

    async def check(self, named: dict[str, int]) -> None:
        """``named``: calendar names and the first line naming each; the first line naming one the
        owner does not have is refused."""
        wanted = [name for name in named if name not in self.known]
        if not wanted:
            return
        if self.catalog.conn is not None:
            missing = await missing_calendars(self.catalog.conn, self.owner, wanted)
        else:  # the catalog could not be opened (with shards): asked once more, without the lock
            missing = await db.with_connection(self.dsn, lambda conn: missing_calendars(conn, self.owner, wanted))
        if missing:
            first = min(missing, key=named.__getitem__)
            raise BadLine(named[first], f"schedule.excludeCalendars: {UnknownCalendar([first])}")
        self.known.update(wanted)


def _homes(dsn: str, shard_map: ShardMap) -> tuple[list[Home], list[int]]:
    """The catalog and each shard of the map, and the index into them of each partition's home."""
    numbered = bool(shard_map.ranges)
    held = ", ".join(f"{first}-{last}" for first, last in shard_map.in_catalog()) or "none"
    homes = [Home("the catalog" if numbered else "the database", dsn, held, numbered)]
    home_of = [0] * PARTITION_COUNT
    by_shard: dict[int, Home] = {}
    for shard_range in shard_map.ranges:
        home = by_shard.get(shard_range.shard_id)
        if home is None:
            home = by_shard[shard_range.shard_id] = Home(f"shard {shard_range.shard_id}", shard_range.url, "", True)
            homes.append(home)
        home.partitions += f"{', ' if home.partitions else ''}{shard_range.first}-{shard_range.last}"
        for partition in range(shard_range.first, shard_range.last + 1):
            home_of[partition] = homes.index(home)
    return homes, home_of


async def _import(dsn: str, file: Path, size: int, owner: str, data_dir: Path | None,
                  processes: int) -> tuple[list[Home], float]:
    """Every line validated and copied into its home's open transaction, then every home committed at
    once: a bad line leaves every database as it was; a home that fails leaves the others to commit."""
    await migrate_database(dsn)
    shard_map = await db.with_connection(dsn, load_map)
    homes, home_of = _homes(dsn, shard_map)
    key = ImportKey(data_dir)  # secret values are sealed before they reach the database
    started = time.perf_counter()
    now = datetime.now(UTC)
    catalog = homes[0]
    calendars = CalendarCheck(dsn, catalog, owner)
    try:
        await catalog.open(migrate_first=False)
        if catalog.error is not None and len(homes) == 1:
            raise click.ClickException(f"the database: {catalog.error}; nothing was imported")
        await asyncio.gather(*(home.open(migrate_first=True) for home in homes[1:]))
        with _progress() as progress:
            task = progress.add_task("importing", total=size)
            async with validators(processes, owner, now, numbered=len(homes) > 1) as validate:
                # Two chunks per process in flight: each has the next one queued when it finishes.
                pending: deque[tuple[Chunk, Awaitable[Rows | Refused | None]]] = deque()

                async def load_oldest() -> None:
                    chunk, rows = pending.popleft()
                    result = await rows
                    if result is None:  # it has secrets: now the key is needed, checked in the catalog
                        keyring = await (key.load(catalog.conn) if catalog.conn is not None
                                         else db.with_connection(dsn, key.load))
                        result = await validate(chunk, keyring)
                    if isinstance(result, Refused):
                        raise BadLine(result.number, result.message)
                    assert result is not None
                    await calendars.check(result.calendars)
                    parts = result.by_home(home_of, len(homes)) if len(homes) > 1 else [result]
                    await asyncio.gather(*(home.copy(part) for home, part in zip(homes, parts, strict=True)))
                    progress.update(task, completed=chunk.end_offset)

                for chunk in chunks(file):
                    pending.append((chunk, validate(chunk, key.keyring)))
                    if len(pending) >= 2 * processes:
                        await load_oldest()
                while pending:
                    await load_oldest()
        note = command_line_note()
        await asyncio.gather(*(home.commit(note, file, owner) for home in homes))
    finally:
        for home in homes:
            home.close()  # a home not committed (a bad line, an interrupt) is rolled back
    return homes, time.perf_counter() - started


def _beside(file: Path) -> Path:
    """``FILE.not-imported.jsonl`` beside FILE, numbered when that name is taken."""
    candidate = file.with_name(f"{file.name}.not-imported.jsonl")
    number = 2
    while candidate.exists():
        candidate = file.with_name(f"{file.name}.not-imported-{number}.jsonl")
        number += 1
    return candidate


def _write_lines(file: Path, numbers: array[int], target: Path) -> None:
    """The lines of ``file`` numbered ``numbers`` (ascending) written to ``target``, as they were."""
    wanted = iter(numbers)
    following = next(wanted, None)
    with file.open("rb") as source, target.open("wb") as out:
        for number, line in enumerate(source, start=1):
            if number == following:
                out.write(line if line.endswith(b"\n") else line + b"\n")
                following = next(wanted, None)
                if following is None:
                    break


def _report(homes: list[Home], file: Path, owner: str, target: Path) -> str:
    """What committed where, what failed and why, and what to do about it."""
    committed = [home for home in homes if home.committed]
    failed = [home for home in homes if not home.committed]
    lines = [f"imported {sum(h.written for h in committed)} jobs into {len(committed)} of {len(homes)} databases; "
             + ("nothing was imported" if not committed else "the import is not complete")]
    lines += [f"  committed: {home.name} (partitions {home.partitions}): {home.written} jobs" for home in committed]
    for home in failed:
        where = f"{home.name} (partitions {home.partitions}, {without_password(home.url)})"
        if home.committing:
            lines.append(f"  UNKNOWN:   {where}: the connection was lost while committing its "
                         f"{len(home.numbers)} jobs ({home.error}): they may or may not be there")
        else:
            lines.append(f"  failed:    {where}: {len(home.numbers)} jobs not imported: {home.error}")
    if not committed:
        lines.append("Fix what is wrong and import the file again.")
        return "\n".join(lines)
    numbers = array("L", sorted(n for home in failed for n in home.numbers))
    lines.append(f"The committed jobs are in place: importing {file} again would create them a second time.")
    if numbers:
        try:
            _write_lines(file, numbers, target)
        except OSError as exc:
            lines.append(f"The {len(numbers)} lines not imported could not be written to {target} ({exc}); they are "
                         f"the jobs of the failed databases: lines {_spans(numbers)} of {file}.")
        else:
            lines.append(f"The {len(numbers)} lines not imported are in {target}: once every database above "
                         f"answers, import that file: chimes jobs import {target} --owner {owner}")
    if any(home.committing for home in failed):
        lines.append(f"First count the jobs of {owner} in the databases marked UNKNOWN and, if they are there, "
                     "leave their lines out of that file.")
    return "\n".join(lines)


def _spans(numbers: array[int]) -> str:
    spans: list[str] = []
    start = previous = numbers[0]
    for number in [*numbers[1:], None]:
        if number is not None and number == previous + 1:
            previous = number
            continue
        spans.append(str(start) if start == previous else f"{start}-{previous}")
        if len(spans) == 20:
            return ", ".join(spans) + ", ..."
        if number is not None:
            start = previous = number
    return ", ".join(spans)


@contextlib.contextmanager
def _without_cycle_collection() -> Iterator[None]:
    """Validated jobs are trees without cycles, freed by reference counting as each chunk goes. The
    cycle collector would still walk every object of the chunk being built, again and again: a fifth
    of the importer's time, for nothing to collect."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeRemainingColumn(),
                    transient=True)
