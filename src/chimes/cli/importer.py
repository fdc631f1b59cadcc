"""``chimes jobs import FILE.jsonl``: load a large set of schedules straight into the database.

Each line is a job exactly as ``POST /jobs`` takes it. Every line is validated by the same rules as
the API; the whole file loads in one transaction, so a bad line (reported with its number and
field) leaves the database as it was.

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
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import click
from pydantic import ValidationError
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

from chimes.api.errors import field_path
from chimes.cli.options import database_options, settings_from
from chimes.cli.runtime import migrate_database
from chimes.cli.security_options import ImportKey
from chimes.jobs import JobSpec
from chimes.security.secrets import Keyring, has_secrets, seal_spec
from chimes.services.jobs import first_fire
from chimes.store import db
from chimes.store.bulk import Rows, copy_rows, job_rows
from chimes.store.shards import load_map

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


def prepare(chunk: Chunk, owner: str, now: datetime, keyring: Keyring | None) -> Rows | Refused | None:
    """The rows of a chunk, its first bad line, or None when it has secret values and no key was
    given yet (the caller loads the key and asks again)."""
    specs = []
    for number, line in enumerate(chunk.lines, start=chunk.first_number):
        if not line.strip():
            continue
        spec = parse_line(line)
        if isinstance(spec, str):
            return Refused(number, spec)
        if has_secrets(spec):
            if keyring is None:
                return None
            spec = seal_spec(spec, keyring)
        specs.append(spec)
    return job_rows(specs, owner, now, first_fire, chunk.id_millis)


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
async def validators(processes: int, owner: str, now: datetime) -> AsyncIterator[Prepare]:
    """``prepare`` in ``processes`` processes; in this one when 1. Each call starts the work at once
    (so several chunks are validated while this process copies) and returns an awaitable of it."""
    if processes <= 1:
        def here(chunk: Chunk, keyring: Keyring | None) -> Awaitable[Rows | Refused | None]:
            done = asyncio.get_running_loop().create_future()
            done.set_result(prepare(chunk, owner, now, keyring))
            return done

        yield here
        return
    loop = asyncio.get_running_loop()
    # spawn, not fork: this process holds a database connection and the progress bar's thread.
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                             initializer=gc.disable) as pool:
        try:
            yield lambda chunk, keyring: loop.run_in_executor(pool, prepare, chunk, owner, now, keyring)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # a bad line: the chunks after it are not needed


@click.command("import")
@database_options
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--owner", required=True, help="The team that will own the imported jobs.")
@click.option("--processes", type=click.IntRange(min=1), envvar="CHIMES_IMPORT_PROCESSES", show_envvar=True,
              default=lambda: os.cpu_count() or 1, show_default="one per core",
              help="Processes validating lines side by side (1: validate in this process).")
def import_jobs(database_url: str | None, data_dir: Path, file: Path, owner: str, processes: int) -> None:
    """Bulk-load jobs from a JSON Lines file (one POST /jobs body per line), all or nothing."""
    source = click.get_current_context().get_parameter_source("processes")
    if source is click.core.ParameterSource.DEFAULT and file.stat().st_size < SMALL_FILE_BYTES:
        processes = 1
    with db.database_url(settings_from(database_url, data_dir)) as dsn, _without_cycle_collection():
        count, seconds = asyncio.run(_import(dsn, file, file.stat().st_size, owner, data_dir, processes))
    click.echo(f"imported {count} jobs in {seconds:.1f}s ({count / max(seconds, 1e-9):,.0f} jobs/s)")


async def _import(dsn: str, file: Path, size: int, owner: str, data_dir: Path | None,
                  processes: int) -> tuple[int, float]:
    await migrate_database(dsn)
    if (await db.with_connection(dsn, load_map)).ranges:  # one COPY per shard is the next step (docs/scaling.md)
        raise click.ClickException("the catalog's shard map gives partitions to other databases: importing into "
                                   "shards is not supported yet; create the jobs through the API")
    key = ImportKey(data_dir)  # secret values are sealed before they reach the database
    started = time.perf_counter()
    now = datetime.now(UTC)
    total = 0
    conn = await db.connect(dsn)
    try:
        with _progress() as progress:
            task = progress.add_task("importing", total=size)
            async with validators(processes, owner, now) as validate, conn.transaction():
                # Two chunks per process in flight: each has the next one queued when it finishes.
                pending: deque[tuple[Chunk, Awaitable[Rows | Refused | None]]] = deque()

                async def load_oldest() -> int:
                    chunk, rows = pending.popleft()
                    result = await rows
                    if result is None:  # it has secrets: now the key is needed
                        result = await validate(chunk, await key.load(conn))
                    if isinstance(result, Refused):
                        raise BadLine(result.number, result.message)
                    assert result is not None
                    written = await copy_rows(conn, result)
                    progress.update(task, completed=chunk.end_offset)
                    return written

                for chunk in chunks(file):
                    pending.append((chunk, validate(chunk, key.keyring)))
                    if len(pending) >= 2 * processes:
                        total += await load_oldest()
                while pending:
                    total += await load_oldest()
    finally:
        await conn.close()
    return total, time.perf_counter() - started


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
