"""``chimes shards``: the shard map, which PostgreSQL database holds which of the 1,024 partitions.

The map lives in the catalog, the database of ``--database-url``; partitions in no shard's range live
in the catalog itself (docs/scaling.md, "Shards")."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import click

from chimes.cli.options import database_options, settings_from
from chimes.cli.runtime import on_migrated_database
from chimes.store import db
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


@shards.command("add")
@database_options
@click.argument("url")
@click.option("--partitions", required=True, metavar="FIRST-LAST",
              help="The range of partitions the new shard holds, both ends included (e.g. 512-1023).")
def add_shard(database_url: str | None, data_dir: Path, url: str, partitions: str) -> None:
    """Give a range of partitions to the PostgreSQL database at URL, after migrating it.

    Refused, with nothing changed, when the range is malformed or overlaps another shard's, when URL is
    the catalog or a database that holds jobs, or when a partition of the range holds jobs already:
    moving partitions that hold jobs is not supported yet. The fleet may run meanwhile: its processes
    follow the map within a second."""
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


def _on_catalog(database_url: str | None, data_dir: Path,
                action: Callable[[db.Connection], Awaitable[T]]) -> T:
    try:
        return on_migrated_database(settings_from(database_url, data_dir), action)
    except shard_store.ShardMapError as exc:
        raise click.ClickException(str(exc)) from None
