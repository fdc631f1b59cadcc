"""``chimes shards``: the shard map, which PostgreSQL database holds which of the 1,024 partitions.

The map lives in the catalog, the database of ``--database-url``; partitions in no shard's range live
in the catalog itself (docs/scaling.md, "Shards")."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import click

from chimes.cli.options import database_options, settings_from
from chimes.cli.runtime import migrate_database, on_migrated_database
from chimes.store import db
from chimes.store import moves as move_store
from chimes.store import shards as shard_store

T = TypeVar("T")


@click.group()
def shards() -> None:
    """The shard map: which PostgreSQL database holds which ranges of the 1,024 partitions.

    With no shards, the catalog (--database-url) holds them all: one database, as always."""


@shards.command("list")
@database_options
def list_shards(database_url: str | None, data_dir: Path) -> None:
    """The map's version, then each range of partitions and where it lives (URLs without passwords)."""
    shard_map = _on_catalog(database_url, data_dir, shard_store.load_map)
    click.echo(f"shard map version {shard_map.version}")
    rows = [(r.first, r.last, f"shard {r.shard_id}", shard_store.without_password(r.url)) for r in shard_map.ranges]
    rows += [(first, last, "catalog", "(the --database-url database)") for first, last in shard_map.in_catalog()]
    for first, last, home, where in sorted(rows):
        click.echo(f"{first}-{last}\t{home}\t{where}")
    for move in _on_catalog(database_url, data_dir, move_store.recent_moves):
        click.echo(move.describe())


@shards.command("add")
@database_options
@click.argument("url")
@click.option("--partitions", required=True, metavar="FIRST-LAST",
              help="The range of partitions the new shard holds, both ends included (e.g. 512-1023).")
def add_shard(database_url: str | None, data_dir: Path, url: str, partitions: str) -> None:
    """Give a range of partitions to the PostgreSQL database at URL, after migrating it.

    Refused, with nothing changed, when the range is malformed or overlaps another shard's, when URL is
    the catalog or a database that holds jobs, or when a partition of the range holds jobs already
    (`chimes shards move` moves those). The fleet may run meanwhile: its processes follow the map
    within a second."""
    try:
        first, last = shard_store.parse_partitions(partitions)
    except shard_store.ShardMapError as exc:
        raise click.BadParameter(str(exc), param_hint="--partitions") from None
    shard_map = _on_catalog(database_url, data_dir, lambda conn: shard_store.add_shard(conn, url, first, last))
    added = shard_map.range_of(first)
    shard = f"shard {added.shard_id}" if added else "a shard"
    click.echo(f"partitions {first}-{last} now live in {shard} ({shard_store.without_password(url)}); "
               f"shard map version {shard_map.version}")
    click.echo("Running API, scheduler and worker processes follow the map within a second: no restart is "
               "needed. Until an API process has read it, the catalog refuses these partitions' new jobs, and the "
               "process reads the map and creates them on the shard.", err=True)


@shards.command("move")
@database_options
@click.argument("partitions", required=False, metavar="FIRST-LAST")
@click.option("--to", "target", metavar="SHARD",
              help="Where the range goes: 'catalog', a shard's id (chimes shards list), or the PostgreSQL URL "
                   "of a database (a new one becomes a shard).")
@click.option("--dry-run", is_flag=True, help="Check the move and say what it would copy; change nothing.")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=60.0, show_default=True, metavar="SEC",
              help="After the fence, how long to wait for the range's runs in flight on the source to end; "
                   "past it the move is cancelled, with nothing lost.")
@click.option("--resume", is_flag=True, help="Take the move under way on from where it is (its mover was stopped).")
@click.option("--cancel", is_flag=True, help="Cancel the move under way, before its cut-over.")
def move_partitions(database_url: str | None, data_dir: Path, partitions: str | None, target: str | None,
                    dry_run: bool, drain_timeout: float, resume: bool, cancel: bool) -> None:
    """Move partitions FIRST-LAST, with their jobs, triggers and run history, to another database while
    the fleet runs.

    The source serves the range while it is copied; then, for about as long as the range's runs in
    flight take to end plus a last copy, the range neither fires nor takes job writes (the API waits
    and replays them), and the catalog hands it to the target (docs/scaling.md, "Moving
    partitions"). A mover that was stopped is taken on with --resume; --cancel gives the range
    back to its source before the cut-over."""
    if sum((partitions is not None, resume, cancel)) != 1:
        raise click.UsageError("give FIRST-LAST (with --to), or --resume, or --cancel")
    if partitions is not None and not target:
        raise click.UsageError("--to is required with FIRST-LAST")

    async def act(catalog: db.Connection, dsn: str) -> None:
        if partitions is not None:
            first, last = shard_store.parse_partitions(partitions)
            assert target is not None
            move, plan = await move_store.begin_move(catalog, dsn, first, last, target, dry_run=dry_run)
            click.echo(plan)
            if move is None:
                return
        else:
            found = await move_store.move_under_way(catalog)
            if found is None:
                raise move_store.MoveError("no move is under way")
            move = found
        await move_store.lock_mover(catalog)
        homes = await move_store.homes_of(catalog, dsn, move)
        mover = move_store.Mover(catalog, homes, move, report=lambda m: click.echo(m.describe()),
                                 drain_timeout_sec=drain_timeout)
        if cancel:
            await mover.open_for_cancel()
            try:
                await mover.cancel("cancelled with chimes shards move --cancel")
            finally:
                await mover.close()
            return
        ended = await mover.run()
        if ended.phase == "cancelled":
            raise move_store.MoveError(f"the move was cancelled: {ended.note}")

    _on_catalog_url(database_url, data_dir, act)


def _on_catalog_url(database_url: str | None, data_dir: Path,
                    action: Callable[[db.Connection, str], Awaitable[None]]) -> None:
    """``action`` on a connection to the migrated catalog, with its URL."""
    async def main(dsn: str) -> None:
        await migrate_database(dsn)
        conn = await db.connect(dsn)
        try:
            await action(conn, dsn)
        finally:
            await conn.close()

    with db.database_url(settings_from(database_url, data_dir)) as dsn:
        try:
            asyncio.run(main(dsn))
        except shard_store.ShardMapError as exc:
            raise click.ClickException(str(exc)) from None


def _on_catalog(database_url: str | None, data_dir: Path,
                action: Callable[[db.Connection], Awaitable[T]]) -> T:
    try:
        return on_migrated_database(settings_from(database_url, data_dir), action)
    except shard_store.ShardMapError as exc:
        raise click.ClickException(str(exc)) from None
