"""``chimes token``: create, list and revoke API tokens, straight in the database."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from chimes.cli.options import database_options, settings_from
from chimes.cli.runtime import migrate_database
from chimes.services import admin as audited
from chimes.store import db
from chimes.store import tokens as token_store

SCOPE_HELP = ("read: only reads its owner's jobs and runs; write: also creates and changes them; "
              "admin: reads and changes every owner's.")


@click.group()
def token() -> None:
    """Manage API tokens (stored hashed; a token is shown once, when created)."""


@token.command("create")
@database_options
@click.option("--owner", required=True, help="The team the token acts for; it sees only this team's jobs.")
@click.option("--scope", type=click.Choice(token_store.SCOPES), default=None, help=f"[default: write] {SCOPE_HELP}")
@click.option("--admin", is_flag=True, help="The same as --scope admin.")
@click.option("--name", default=None, help="A note saying what the token is for.")
def create(database_url: str | None, data_dir: Path, owner: str, scope: str | None, admin: bool,
           name: str | None) -> None:
    """Create a token and print it."""
    if not owner.strip() or len(owner) > 100:
        raise click.BadParameter("must be 1 to 100 characters", param_hint="--owner")
    if admin and scope not in (None, "admin"):
        raise click.BadParameter(f"--admin contradicts --scope {scope}", param_hint="--scope")
    scope = "admin" if admin else scope or "write"

    async def main(dsn: str) -> str:
        await migrate_database(dsn)
        conn = await db.connect(dsn)
        try:
            return await audited.create_token(conn, audited.command_line_note(), owner.strip(), scope, name)
        finally:
            await conn.close()

    with db.database_url(settings_from(database_url, data_dir)) as dsn:
        click.echo(asyncio.run(main(dsn)))


@token.command("list")
@database_options
def list_tokens(database_url: str | None, data_dir: Path) -> None:
    """List tokens (never their secrets)."""

    async def main(dsn: str) -> list[token_store.TokenInfo]:
        await migrate_database(dsn)
        conn = await db.connect(dsn)
        try:
            return await token_store.list_tokens(conn)
        finally:
            await conn.close()

    with db.database_url(settings_from(database_url, data_dir)) as dsn:
        rows = asyncio.run(main(dsn))
    table = Table("id", "owner", "scope", "name", "created", "revoked")
    for r in rows:
        revoked = f"{r.revoked_at:%Y-%m-%d %H:%M}" if r.revoked_at else ""
        table.add_row(str(r.token_id), r.owner, r.scope, r.name or "", f"{r.created_at:%Y-%m-%d %H:%M}", revoked)
    Console(width=160).print(table)


@token.command("revoke")
@database_options
@click.argument("token_id", type=click.UUID)
def revoke(database_url: str | None, data_dir: Path, token_id: uuid.UUID) -> None:
    """Revoke a token by its id (see chimes token list); it stops working at once."""

    async def main(dsn: str) -> bool:
        conn = await db.connect(dsn)
        try:
            return await audited.revoke_token(conn, audited.command_line_note(), token_id)
        finally:
            await conn.close()

    with db.database_url(settings_from(database_url, data_dir)) as dsn:
        if not asyncio.run(main(dsn)):
            raise click.ClickException(f"no active token with id {token_id}")
    click.echo(f"revoked {token_id}")
