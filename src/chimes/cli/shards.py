"""``chimes shards``: the shard map, which PostgreSQL database holds which of the 1,024 partitions.

The map lives in the catalog, the database of ``--database-url``; partitions in no shard's range live
in the catalog itself (docs/scaling.md, "Shards")."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import click

from chimes import moves, outage
from chimes.cli.options import database_options, settings_from
from chimes.cli.runtime import migrate_database, on_migrated_database
from chimes.store import db, rebalance
from chimes.store import moves as move_store
from chimes.store import shards as shard_store

T = TypeVar("T")
# Tests kill a mover process at each of its stop points (moves.STOP_POINTS), named here.
STOP_AT_ENV = "CHIMES_MOVE_STOP_AT"


@click.group()
def shards() -> None:
    """The shard map: which PostgreSQL database holds which ranges of the 1,024 partitions.

    With no shards, the catalog (--database-url) holds them all: one database, as always."""


@shards.command("list")
@database_options
def list_shards(database_url: str | None, data_dir: Path) -> None:
    """The map's version, then each range of partitions and where it lives (URLs without passwords),
    the shards registered with no range yet (a move's target before its cut-over), and the moves with
    their movers' liveness."""
    shard_map = _on_catalog(database_url, data_dir, shard_store.load_map)
    click.echo(f"shard map version {shard_map.version}")
    rows = [(r.first, r.last, f"shard {r.shard_id}", shard_store.without_password(r.url)) for r in shard_map.ranges]
    rows += [(first, last, "catalog", "(the --database-url database)") for first, last in shard_map.in_catalog()]
    for first, last, home, where in sorted(rows):
        click.echo(f"{first}-{last}\t{home}\t{where}")
    for shard_id, url in _on_catalog(database_url, data_dir, shard_store.shards_without_ranges):
        click.echo(f"-\tshard {shard_id}\t{shard_store.without_password(url)} (registered, no partitions yet: the "
                   "target of a move before its cut-over)")
    recent = _on_catalog(database_url, data_dir, move_store.recent_moves)
    if recent:
        under_way = "the one under way first, then " if recent[0].under_way else ""
        click.echo(f"moves ({under_way}the last ended, newest first):")
    for move in recent:
        click.echo(f"  {move.describe()}")


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
            await carry_out_move(catalog, dsn, first, last, target, drain_timeout=drain_timeout, dry_run=dry_run)
            return
        found = await move_store.move_under_way(catalog)
        if found is None:
            raise moves.MoveError("no move is under way")
        mover = await _mover_of(catalog, dsn, found, drain_timeout)
        if cancel:
            await mover.connect()
            try:
                await mover.cancel("cancelled with chimes shards move --cancel")
            finally:
                await mover.close()
            return
        await _run_to_the_end(mover)

    _on_catalog_url(database_url, data_dir, act)


async def carry_out_move(catalog: db.Connection, dsn: str, first: int, last: int, target: str, *,
                         drain_timeout: float, dry_run: bool = False) -> None:
    """What ``chimes shards move FIRST-LAST --to TARGET`` does, from the check to the clean-up, each
    phase reported on stdout; MoveError when it was refused or cancelled."""
    move, plan = await moves.begin_move(catalog, dsn, first, last, target, dry_run=dry_run)
    click.echo(plan)
    if move is not None:
        await _run_to_the_end(await _mover_of(catalog, dsn, move, drain_timeout))


async def _mover_of(catalog: db.Connection, dsn: str, move: move_store.Move,
                    drain_timeout: float) -> moves.Mover:
    await moves.lock_mover(catalog)
    homes = await moves.homes_of(catalog, dsn, move)
    return moves.Mover(catalog, homes, move, report=lambda m: click.echo(m.describe(mover=False)),
                       drain_timeout_sec=drain_timeout, stop_at=_stop_at())


def _stop_at() -> moves.StopHook | None:
    """With STOP_AT_ENV set to one of the mover's stop points, the mover holds there until it is killed."""
    point = os.environ.get(STOP_AT_ENV)
    if not point:
        return None
    return moves.hold_at(point, say=lambda line: click.echo(f"{line} ({STOP_AT_ENV})"))


async def _run_to_the_end(mover: moves.Mover) -> None:
    try:
        ended = await mover.run()
    except db.DB_ERRORS as exc:
        # Every phase is recorded as it is reached: the move is where its row says, and goes on from there.
        raise moves.MoveError(
            f"move {mover.move.move_id} stopped, {mover.move.phase}: a database it uses failed, "
            f"{outage.database_of(exc).label} ({db.describe(exc).splitlines()[0]}); nothing is lost: `chimes "
            "shards move --resume` takes it on from there, `--cancel` gives the range back (before the cut-over)"
        ) from exc
    if ended.phase == "cancelled":
        raise moves.MoveError(f"the move was cancelled: {ended.note}")


@shards.command("rebalance")
@database_options
@click.option("--by", "measure", type=click.Choice(rebalance.MEASURES), default="jobs", show_default=True,
              help="What to even out between the homes: their jobs, or the triggers due within the next hour.")
@click.option("--apply", "apply_moves", is_flag=True,
              help="Make the proposed moves, one after the other, as chimes shards move does.")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=60.0, show_default=True, metavar="SEC",
              help="With --apply: each move's drain timeout (chimes shards move --drain-timeout).")
def rebalance_shards(database_url: str | None, data_dir: Path, measure: str, apply_moves: bool,
                     drain_timeout: float) -> None:
    """Propose moves that even out the jobs (or the triggers due soon) of the catalog and the shards.

    Counts each partition's jobs on the database that holds it, then proposes moves of ranges taken
    at the edge of the most loaded database's ranges to the least loaded, until no move would narrow
    the gap between them by more than 5% of the mean per database. Prints each move as the
    chimes shards move command that makes it, and the counts after. Changes nothing without --apply
    (docs/scaling.md, "Rebalancing")."""

    async def act(catalog: db.Connection, dsn: str) -> None:
        under_way = await move_store.move_under_way(catalog)
        if under_way is not None:
            raise moves.MoveError(f"a move is under way ({under_way.describe()}): rebalance once it has "
                                  "ended (chimes shards move --resume, or --cancel)")
        shard_map = await shard_store.load_map(catalog)
        owners = rebalance.owners_of(shard_map)
        if len(rebalance.homes_of(owners)) < 2:
            click.echo("one database holds every partition: there is nothing to rebalance. Rebalancing needs a "
                       "second database: chimes shards add URL --partitions FIRST-LAST, or chimes shards move "
                       "FIRST-LAST --to URL.")
            return
        plan = rebalance.plan_moves(owners, await rebalance.read_counts(dsn, shard_map, measure))
        unit = "jobs" if measure == "jobs" else "triggers due within the hour"
        _print_plan(plan, unit)
        if not plan.moves:
            return
        if not apply_moves:
            click.echo("nothing was changed: run them with chimes shards rebalance --apply, or one at a time")
            return
        for done, move in enumerate(plan.moves):
            try:
                await carry_out_move(catalog, dsn, move.first, move.last, rebalance.home_label(move.target),
                                     drain_timeout=drain_timeout)
            except shard_store.ShardMapError as exc:
                raise moves.MoveError(f"{exc}; {done} of the {len(plan.moves)} moves were made "
                                      "(chimes shards list; chimes shards rebalance plans again)") from None
        shard_map = await shard_store.load_map(catalog)
        now = rebalance.loads_of(rebalance.owners_of(shard_map), await rebalance.read_counts(dsn, shard_map, measure))
        click.echo(f"rebalanced: {rebalance.describe_loads(now, unit)} (spread {rebalance.spread(now):,})")

    _on_catalog_url(database_url, data_dir, act)


def _print_plan(plan: rebalance.Plan, unit: str) -> None:
    click.echo(f"now:   {rebalance.describe_loads(plan.before, unit)} (spread {plan.spread_before:,})")
    if not plan.moves:
        click.echo(f"no move would narrow the spread by more than {rebalance.MIN_GAIN:.0%} of the mean "
                   "per database: nothing to do")
        return
    click.echo(f"{len(plan.moves)} move{'s' if len(plan.moves) > 1 else ''}, in this order:")
    for move in plan.moves:
        click.echo(f"  {move.command()}    # {move.load:,} {unit}, "
                   f"{move_store.home_name(move.source)} -> {move_store.home_name(move.target)}")
    click.echo(f"after: {rebalance.describe_loads(plan.after, unit)} (spread {plan.spread_after:,})")


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
