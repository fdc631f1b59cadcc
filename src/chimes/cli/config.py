"""``chimes config``: operator settings kept in the database (the catalog, copied to every shard), read
by every role."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import click

from chimes.cli.options import database_options, settings_from
from chimes.cli.runtime import migrate_database
from chimes.store import db
from chimes.store import settings as stored_settings

KNOWN = {
    "notify-url": "notify_url",  # the webhook for failures of jobs that name none
    "runs-fillfactor": "runs_fillfactor",  # how full a page of run history is written (docs/operations.md)
}
FILLFACTOR_RANGE = (10, 100)  # PostgreSQL's bounds for a table


@click.group()
def config() -> None:
    """Operator settings shared by the whole fleet."""


@config.command("set")
@database_options
@click.argument("name", type=click.Choice(sorted(KNOWN)))
@click.argument("value")
def set_value(database_url: str | None, data_dir: Path, name: str, value: str) -> None:
    """Set a setting, e.g. `chimes config set notify-url https://alerts.internal/chimes`."""
    stored = _checked(name, value)
    _run(database_url, data_dir, lambda conn: stored_settings.change_everywhere(conn, KNOWN[name], stored))
    click.echo(f"{name} = {value}")


def _checked(name: str, value: str) -> str | int:
    """The value as it is stored, or a clear error before anything is written."""
    if name == "notify-url" and not value.startswith(("http://", "https://")):
        raise click.BadParameter("must be an http:// or https:// URL", param_hint="VALUE")
    if name == "runs-fillfactor":
        low, high = FILLFACTOR_RANGE
        if not value.isdigit() or not low <= int(value) <= high:
            raise click.BadParameter(f"must be a whole number from {low} to {high} (percent of a page)",
                                     param_hint="VALUE")
        return int(value)
    return value


@config.command("unset")
@database_options
@click.argument("name", type=click.Choice(sorted(KNOWN)))
def unset(database_url: str | None, data_dir: Path, name: str) -> None:
    """Remove a setting."""
    _run(database_url, data_dir, lambda conn: stored_settings.change_everywhere(conn, KNOWN[name], None))
    click.echo(f"{name} unset")


def _run(database_url: str | None, data_dir: Path, change: Callable[[db.Connection], Awaitable[None]]) -> None:
    async def main(dsn: str) -> None:
        await migrate_database(dsn)
        conn = await db.connect(dsn)
        try:
            await change(conn)
        finally:
            await conn.close()

    with db.database_url(settings_from(database_url, data_dir)) as dsn:
        asyncio.run(main(dsn))
