"""``chimes cap``: fleet-wide caps on how many runs of an owner or of a tag run at once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import click

from chimes.cli.options import database_options, settings_from
from chimes.cli.runtime import migrate_database
from chimes.store import db
from chimes.store.queries import sql


def parse_target(value: str) -> tuple[str, str]:
    scope, sep, name = value.partition(":")
    if not sep or scope not in ("owner", "tag") or not name:
        raise click.BadParameter("must be owner:NAME or tag:NAME", param_hint="TARGET")
    return scope, name


@click.group()
def cap() -> None:
    """Cap how many runs of an owner (owner:TEAM) or of jobs with a tag (tag:NAME) run at once.

    Runs over a cap wait in the queue, in order; none is dropped."""


@cap.command("set")
@database_options
@click.argument("target")
@click.argument("max_running", type=click.IntRange(0, 1_000_000))
def set_cap(database_url: str | None, data_dir: Path, target: str, max_running: int) -> None:
    """Set a cap, e.g. `chimes cap set tag:db-heavy 20`."""
    scope, name = parse_target(target)
    _with_connection(database_url, data_dir, lambda conn: conn.execute(sql("set_cap"), scope, name, max_running))
    click.echo(f"{target}: at most {max_running} running")


@cap.command("remove")
@database_options
@click.argument("target")
def remove_cap(database_url: str | None, data_dir: Path, target: str) -> None:
    """Remove a cap."""
    scope, name = parse_target(target)
    if _with_connection(database_url, data_dir, lambda conn: conn.fetchval(sql("remove_cap"), scope, name)) is None:
        raise click.ClickException(f"no cap on {target}")
    click.echo(f"{target}: no cap")


@cap.command("list")
@database_options
def list_caps(database_url: str | None, data_dir: Path) -> None:
    """List the caps."""
    for row in _with_connection(database_url, data_dir, lambda conn: conn.fetch(sql("list_caps"))):
        click.echo(f"{row['scope']}:{row['name']}\t{row['max_running']}")


def _with_connection(database_url: str | None, data_dir: Path,
                     action: Callable[[asyncpg.Connection], Awaitable[Any]]) -> Any:
    async def main(dsn: str) -> Any:
        await migrate_database(dsn)
        conn = await db.connect(dsn)
        try:
            return await action(conn)
        finally:
            await conn.close()

    with db.database_url(settings_from(database_url, data_dir)) as dsn:
        return asyncio.run(main(dsn))
