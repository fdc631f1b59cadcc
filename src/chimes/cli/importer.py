"""``chimes jobs import FILE.jsonl``: load a large set of schedules straight into the database.

Each line is a job exactly as ``POST /jobs`` takes it. Every line is validated by the same rules as
the API; the whole file loads in one transaction, so a bad line (reported with its number and
field) leaves the database as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import click
from pydantic import ValidationError
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

from chimes.api.errors import field_path
from chimes.cli.options import database_options, settings_from
from chimes.cli.runtime import migrate_database
from chimes.cli.security_options import Sealer
from chimes.jobs import JobSpec
from chimes.store import db
from chimes.store.bulk import copy_jobs

CHUNK = 5000


class BadLine(click.ClickException):
    def __init__(self, number: int, message: str) -> None:
        super().__init__(f"line {number}: {message}; nothing was imported")


def parse_line(number: int, line: bytes) -> JobSpec:
    try:
        return JobSpec.model_validate_json(line)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = field_path(first.get("loc", ()))
        text = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        if first.get("type") == "json_invalid":
            raise BadLine(number, "not valid JSON") from None
        raise BadLine(number, f"{where}: {text}") from None


@click.command("import")
@database_options
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--owner", required=True, help="The team that will own the imported jobs.")
def import_jobs(database_url: str | None, data_dir: Path, file: Path, owner: str) -> None:
    """Bulk-load jobs from a JSON Lines file (one POST /jobs body per line), all or nothing."""
    with db.database_url(settings_from(database_url, data_dir)) as dsn, _without_cycle_collection():
        count, seconds = asyncio.run(_import(dsn, file, file.stat().st_size, owner, data_dir))
    click.echo(f"imported {count} jobs in {seconds:.1f}s ({count / max(seconds, 1e-9):,.0f} jobs/s)")


async def _import(dsn: str, file: Path, size: int, owner: str, data_dir: Path | None = None) -> tuple[int, float]:
    await migrate_database(dsn)
    sealer = Sealer(data_dir)  # secret values are sealed before they reach the database
    started = time.perf_counter()
    now = datetime.now(UTC)
    total = 0
    conn = await db.connect(dsn)
    try:
        with _progress() as progress:
            task = progress.add_task("importing", total=size)
            async with conn.transaction():
                chunk: list[JobSpec] = []
                with file.open("rb") as lines:
                    for number, line in enumerate(lines, start=1):
                        if not line.strip():
                            continue
                        chunk.append(await sealer.seal(conn, parse_line(number, line)))
                        if len(chunk) >= CHUNK:
                            total += len(await copy_jobs(conn, owner, chunk, now))
                            chunk = []
                            progress.update(task, completed=lines.tell())  # per chunk: per line costs
                total += len(await copy_jobs(conn, owner, chunk, now))
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


