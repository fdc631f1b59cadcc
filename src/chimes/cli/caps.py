"""``chimes cap``: fleet-wide caps on how many runs of an owner, or of an owner's tag, run at once.

A tag is each team's own word, so a tag cap names the owner whose jobs it counts (``--owner``); a cap
over every owner's jobs with a tag (``--fleet-wide``) lets one team's jobs hold the slots another's
wait for, and is the operator's explicit decision (docs/security.md)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import click

from chimes.cli.options import database_options, settings_from
from chimes.cli.runtime import on_migrated_database
from chimes.services import admin
from chimes.store import caps as cap_store
from chimes.store import db


def parse_target(value: str) -> tuple[str, str]:
    scope, sep, name = value.partition(":")
    if not sep or scope not in ("owner", "tag") or not name:
        raise click.BadParameter("must be owner:NAME or tag:NAME", param_hint="TARGET")
    return scope, name


def cap_owner(scope: str, owner: str | None, fleet_wide: bool) -> str:
    """The owner column of a cap: a tag cap needs exactly one of --owner and --fleet-wide."""
    if scope == "owner":
        if owner is not None or fleet_wide:
            raise click.UsageError("--owner and --fleet-wide are for tag caps; owner:NAME already names the owner")
        return ""
    if (owner is None) == (not fleet_wide):
        raise click.UsageError("a tag cap needs --owner TEAM (that team's jobs with the tag) or --fleet-wide "
                               "(every team's jobs with the tag share the slots)")
    if owner is not None and not owner:
        raise click.BadParameter("must not be empty", param_hint="--owner")
    return owner or ""


def describe(scope: str, name: str, owner: str) -> str:
    if scope == "owner":
        return f"owner:{name}"
    return f"tag:{name} of owner {owner}" if owner else f"tag:{name} of every owner (fleet-wide)"


def _tag_cap_options(func: Callable[..., Any]) -> Callable[..., Any]:
    func = click.option("--fleet-wide", is_flag=True,
                        help="A tag cap over every owner's jobs with the tag: teams share its slots.")(func)
    return click.option("--owner", default=None, metavar="TEAM",
                        help="The owner whose jobs with the tag a tag cap counts.")(func)


@click.group()
def cap() -> None:
    """Cap how many runs of an owner (owner:TEAM) or of jobs with a tag (tag:NAME --owner TEAM, or
    --fleet-wide for every owner's) run at once.

    Runs over a cap wait in the queue, in order; none is dropped."""


@cap.command("set")
@database_options
@click.argument("target")
@click.argument("max_running", type=click.IntRange(0, 1_000_000))
@_tag_cap_options
def set_cap(database_url: str | None, data_dir: Path, target: str, max_running: int, owner: str | None,
            fleet_wide: bool) -> None:
    """Set a cap, e.g. `chimes cap set tag:db-heavy 20 --owner data-team` or `chimes cap set owner:data-team 50`."""
    scope, name = parse_target(target)
    who = cap_owner(scope, owner, fleet_wide)
    cap_row = cap_store.Cap(scope, name, who, max_running)
    _with_connection(database_url, data_dir, lambda conn: admin.set_cap(conn, admin.command_line_note(), cap_row))
    click.echo(f"{describe(scope, name, who)}: at most {max_running} running")


@cap.command("remove")
@database_options
@click.argument("target")
@_tag_cap_options
def remove_cap(database_url: str | None, data_dir: Path, target: str, owner: str | None, fleet_wide: bool) -> None:
    """Remove a cap (a tag cap with the same --owner or --fleet-wide it was set with)."""
    scope, name = parse_target(target)
    who = cap_owner(scope, owner, fleet_wide)
    if not _with_connection(database_url, data_dir,
                            lambda conn: admin.remove_cap(conn, admin.command_line_note(), scope, name, who)):
        raise click.ClickException(f"no cap on {describe(scope, name, who)}")
    click.echo(f"{describe(scope, name, who)}: no cap")


@cap.command("list")
@database_options
def list_caps(database_url: str | None, data_dir: Path) -> None:
    """List the caps: target, whose jobs it counts, most running."""
    for row in _with_connection(database_url, data_dir, cap_store.list_caps):
        whose = row.name if row.scope == "owner" else row.owner or "every owner (fleet-wide)"
        click.echo(f"{row.scope}:{row.name}\t{whose}\t{row.max_running}")


def _with_connection(database_url: str | None, data_dir: Path,
                     action: Callable[[db.Connection], Awaitable[Any]]) -> Any:
    return on_migrated_database(settings_from(database_url, data_dir), action)
