"""``chimes migrate``: expand steps (what every process applies at start-up), ``--plan`` (what an
upgrade to this release will do, changing nothing) and ``--contract`` (the contract steps, once no live
process predates them). The catalog and every shard of its map (docs/operations.md, "Upgrades")."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import click

from chimes.cli.options import database_options, settings_from
from chimes.cli.runtime import migrate_database
from chimes.store import db, shards
from chimes.store.migrate import applied_steps
from chimes.store.migrate import migrate as apply_migrations
from chimes.store.upgrades import UpgradePlan, read_home_plan, upgrade_plan


async def _homes(dsn: str) -> list[tuple[str, str]]:
    """(name, URL) of the catalog and of each shard its map names, "shard N" as the fleet page names it."""
    async def shards_of(conn: db.Connection) -> list[tuple[str, str]]:
        if not await applied_steps(conn):
            return []  # a database no process has used yet has no shard map
        ranges = (await shards.load_map(conn)).ranges
        return list(dict.fromkeys((f"shard {r.shard_id}", r.url) for r in ranges))

    return [("catalog", dsn), *await db.with_connection(dsn, shards_of)]


async def read_plan(dsn: str) -> UpgradePlan:
    """What an upgrade to this release would do to the catalog and each shard; reads only."""
    return upgrade_plan([await db.with_connection(url, functools.partial(read_home_plan, home=name))
                         for name, url in await _homes(dsn)])


async def contract_homes(dsn: str) -> list[tuple[str, list[int]]]:
    """Apply every pending step, contract steps too, to the catalog and then to each shard, once no live
    process of any of them predates a pending contract step; otherwise change nothing."""
    plan = await read_plan(dsn)
    if not plan.can_contract:
        raise click.ClickException(f"not contracting:\n{plan.describe()}")
    done = []
    for name, url in await _homes(dsn):
        applied = await db.with_connection(url, lambda conn: apply_migrations(conn, contract=True))
        done.append((name, applied))
    return done


@click.command()
@database_options
@click.option("--plan", "show_plan", is_flag=True,
              help="Print what an upgrade to this release will do, and whether it can roll; change nothing.")
@click.option("--contract", is_flag=True,
              help="Also apply the contract steps, once no live process is of a release they predate.")
def migrate(database_url: str | None, data_dir: Path, show_plan: bool, contract: bool) -> None:
    """Apply pending schema migrations (every process applies the expand steps at start-up)."""
    if show_plan and contract:
        raise click.UsageError("--plan changes nothing: give it alone, or --contract alone")
    with db.database_url(settings_from(database_url, data_dir)) as dsn:
        if show_plan:
            click.echo(asyncio.run(read_plan(dsn)).describe())
            return
        # Without --contract, the catalog only, as before: each role migrates a shard when it serves it.
        done = asyncio.run(contract_homes(dsn)) if contract else [("catalog", asyncio.run(migrate_database(dsn)))]
        for name, applied in done:
            heading = "" if name == "catalog" else f"{name}: "
            click.echo(f"{heading}applied migrations: {', '.join(map(str, applied))}" if applied
                       else f"{heading}schema is up to date")
