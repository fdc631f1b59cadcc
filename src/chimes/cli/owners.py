"""``chimes owner``: what the operator allows each team (command tasks, job quota), and its signing secret.

These settings live in the database, so every API process and every worker sees the same ones
(workers within half a minute; see docs/security.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table

from chimes.cli.options import database_options, settings_from
from chimes.cli.runtime import migrate_database
from chimes.cli.security_options import key_file_option, keyring_from
from chimes.security.secrets import SecretKeyError
from chimes.services import admin
from chimes.services.owners import check_secret_key
from chimes.store import db
from chimes.store.owners import OwnerStore

T = TypeVar("T")


def _run(database_url: str | None, data_dir: Path, work: Callable[[db.Connection], Awaitable[T]]) -> T:
    async def main(dsn: str) -> T:
        await migrate_database(dsn)
        conn = await db.connect(dsn)
        try:
            return await work(conn)
        finally:
            await conn.close()

    with db.database_url(settings_from(database_url, data_dir)) as dsn:
        return asyncio.run(main(dsn))


def _owner(value: str) -> str:
    if not value.strip() or len(value) > 100:
        raise click.BadParameter("must be 1 to 100 characters", param_hint="OWNER")
    return value.strip()


@click.group()
def owner() -> None:
    """What each owner (team) may do: command tasks, job quota; and its signing secret."""


@owner.command("set")
@database_options
@click.argument("name", metavar="OWNER")
@click.option("--allow-commands/--deny-commands", default=None,
              help="Whether the owner's jobs may run command and container tasks (on workers started with "
                   "--allow-commands). Default for a new owner: denied.")
@click.option("--job-quota", type=click.IntRange(0), default=None, help="Most jobs the owner may have.")
@click.option("--default-quota", is_flag=True, help="Use the API's --default-job-quota again.")
def set_owner(database_url: str | None, data_dir: Path, name: str, allow_commands: bool | None,
              job_quota: int | None, default_quota: bool) -> None:
    """Change what OWNER may do; options not given stay as they are."""
    name = _owner(name)
    if default_quota and job_quota is not None:
        raise click.BadParameter("give --job-quota or --default-quota, not both", param_hint="--default-quota")

    async def work(conn: db.Connection) -> Any:
        return await admin.set_owner(conn, admin.command_line_note(), name, allow_commands=allow_commands,
                                     job_quota=job_quota, default_quota=default_quota)

    settings = _run(database_url, data_dir, work)
    quota = "the API's default" if settings.job_quota is None else str(settings.job_quota)
    click.echo(f"{name}: command tasks {'allowed' if settings.allow_commands else 'denied'}, job quota {quota}")


@owner.command("list")
@database_options
def list_owners(database_url: str | None, data_dir: Path) -> None:
    """List the owners the operator configured or that made jobs, with their settings."""
    rows = _run(database_url, data_dir, lambda conn: OwnerStore(conn).list())
    table = Table("owner", "command tasks", "job quota", "jobs", "signing secret")
    for row in rows:
        table.add_row(row.owner, "allowed" if row.allow_commands else "denied",
                      "default" if row.job_quota is None else str(row.job_quota), str(row.jobs),
                      "set" if row.has_signing_secret else "not yet")
    Console(width=160).print(table)


@owner.command("signing-secret")
@database_options
@key_file_option
@click.argument("name", metavar="OWNER")
@click.option("--rotate", is_flag=True, help="Replace it with a new one (workers use it within 30 s).")
def signing_secret(database_url: str | None, data_dir: Path, secret_key_file: Path | None, name: str,
                   rotate: bool) -> None:
    """Print OWNER's signing secret (made if it has none): its targets verify X-Chimes-Signature with it."""
    name = _owner(name)
    keyring = keyring_from(data_dir, secret_key_file)

    async def work(conn: db.Connection) -> str:
        await check_secret_key(conn, keyring)
        return await admin.signing_secret(conn, admin.command_line_note(), name, keyring, rotate=rotate)

    try:
        click.echo(_run(database_url, data_dir, work))
    except SecretKeyError as exc:
        raise click.ClickException(str(exc)) from None
