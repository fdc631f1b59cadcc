"""``chimes ha``: Chimes on a highly available PostgreSQL (Patroni and etcd) on this machine.

To try a failover, test against one, or measure one; production runs the same pieces on several
hosts (docs/high-availability.md).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import click

from chimes.cli.options import listen_options, settings_from
from chimes.cli.runtime import run_async
from chimes.cli.security_options import (
    allow_commands_option,
    api_security,
    api_security_options,
    egress_loopback_option,
    key_file_option,
    worker_security,
    worker_security_options,
)
from chimes.settings import WORKER_CONCURRENCY, default_data_dir

data_dir_option = click.option(
    "--data-dir", envvar="CHIMES_DATA_DIR", show_envvar=True, type=click.Path(path_type=Path),
    default=default_data_dir(), show_default=True,
    help="The cluster lives in DATA_DIR/ha (etcd, PostgreSQL, Patroni, ha.json with its ports and passwords).")


def _cluster(data_dir: Path, members: int = 3, backup_repo: Path | None = None) -> Any:
    from chimes.ha.cluster import HaCluster

    return HaCluster(data_dir.expanduser() / "ha", postgres=members, backup_repo=backup_repo)


@click.group()
def ha() -> None:
    """A Patroni-managed PostgreSQL cluster on this machine, and Chimes on it."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per call to Patroni's REST API otherwise


@ha.command()
@data_dir_option
@click.option("--members", type=click.IntRange(2, 5), default=3, show_default=True,
              help="PostgreSQL servers, each under its own Patroni (only on the first start of DATA_DIR).")
@click.option("--rejoin-after", type=click.FloatRange(1), default=60.0, show_default=True,
              help="Seconds after which a member found dead (killed on purpose, say) is started again; a "
                   "former primary rejoins as a standby. Keep it above Patroni's TTL (20 s), or a killed "
                   "primary may come back before its standby is promoted.")
@click.option("--worker-concurrency", envvar="CHIMES_WORKER_CONCURRENCY", show_envvar=True, default=WORKER_CONCURRENCY,
              show_default=True, type=click.IntRange(1, 10_000), help="Runs the built-in worker executes at once.")
@click.option("--backup-repo", type=click.Path(path_type=Path), default=None,
              help="Archive WAL and take backups (chimes ha backup) with pgBackRest into this repository; "
                   "remembered in ha.json.")
@listen_options
@api_security_options
@worker_security_options
@egress_loopback_option(default=True)
@allow_commands_option(default=True)
@key_file_option
def up(data_dir: Path, members: int, rejoin_after: float, worker_concurrency: int, backup_repo: Path | None,
       host: str, port: int, **security: Any) -> None:
    """etcd (3 members), PostgreSQL under Patroni in synchronous mode, and the API, a scheduler node
    and a worker on it, in one command. Kill the primary (chimes ha kill-primary) and watch the jobs go on."""
    from chimes.cli.roles import run_all_in_one
    from chimes.ha.runtime import HaUnavailable

    cluster = _cluster(data_dir, members, backup_repo)
    click.echo(f"starting etcd and {len(cluster.postgres)} PostgreSQL servers under Patroni in {cluster.base} ...",
               err=True)
    try:
        cluster.start()
    except HaUnavailable as exc:
        cluster.stop()
        raise click.ClickException(str(exc)) from None
    dsn = cluster.database_url()
    click.echo(f"PostgreSQL is up: primary {cluster.primary().name}; the URL (with its password) is in "
               f"{cluster.base / 'ha.json'}", err=True)
    stopping = threading.Event()
    watcher = threading.Thread(target=_rejoin_dead_members, args=(cluster, rejoin_after, stopping), daemon=True)
    watcher.start()
    settings = settings_from(dsn, data_dir, host, port)
    try:
        run_async(lambda: run_all_in_one(dsn, settings, worker_concurrency, api_security(data_dir, security),
                                         worker_security(data_dir, security)))
    finally:
        stopping.set()
        cluster.stop()


def _rejoin_dead_members(cluster: Any, after: float, stopping: threading.Event) -> None:
    dead_since: dict[str, float] = {}
    while not stopping.wait(1.0):
        now = time.monotonic()
        for member in [*cluster.etcd, *cluster.postgres]:
            if member.alive:
                dead_since.pop(member.name, None)
            elif now - dead_since.setdefault(member.name, now) >= after:
                click.echo(f"{member.name} is not running: starting it again", err=True)
                member.start()
                dead_since.pop(member.name, None)


@ha.command()
@data_dir_option
def status(data_dir: Path) -> None:
    """Each PostgreSQL member's role, state, timeline and replication lag, as Patroni sees them."""
    cluster = _cluster(data_dir)
    members = cluster.members()
    if not members:
        raise click.ClickException(f"no Patroni member answers (is `chimes ha up --data-dir {data_dir}` running?)")
    for member in members:
        lag = member.get("lag", "")
        click.echo(f"{member['name']:6} {member['role']:13} {member['state']:10} timeline {member.get('timeline', '?')}"
                   f"{f'  lag {lag}' if lag != '' else ''}")


@ha.command()
@data_dir_option
@click.option("--to", "candidate", default=None, help="The member to promote (default: Patroni's choice).")
def switchover(data_dir: Path, candidate: str | None) -> None:
    """A planned switchover: the primary hands over to a synchronous standby."""
    cluster = _cluster(data_dir)
    chosen = next((m for m in cluster.postgres if m.name == candidate), None) if candidate else None
    if candidate and chosen is None:
        raise click.BadParameter(f"no member named {candidate!r}", param_hint="--to")
    new = cluster.switchover(chosen)
    click.echo(f"{new.name} is the primary")


@ha.command()
@data_dir_option
@click.option("--type", "kind", type=click.Choice(["full", "diff", "incr"]), default="incr", show_default=True,
              help="full: everything; diff: what changed since the last full; incr: since the last backup of any type "
                   "(pgBackRest takes a full one when there is none yet).")
def backup(data_dir: Path, kind: str) -> None:
    """A pgBackRest backup of the cluster (started with --backup-repo), taken from a standby; then the
    repository's contents (pgbackrest info). Run it on a schedule: deploy/pgbackrest."""
    from chimes.ha.runtime import HaUnavailable

    cluster = _cluster(data_dir)
    if cluster.backups is None:
        raise click.ClickException(f"the cluster in {cluster.base} archives no WAL: start it once with "
                                   f"chimes ha up --backup-repo DIR")
    try:
        click.echo(cluster.backups.backup(kind, cluster.layout.superuser_password))
    except HaUnavailable as exc:
        raise click.ClickException(str(exc)) from None


@ha.command("kill-primary")
@data_dir_option
def kill_primary(data_dir: Path) -> None:
    """SIGKILL the primary's PostgreSQL and Patroni, as if its host were gone; Patroni promotes the
    synchronous standby once the leader lock expires (about 20 s)."""
    cluster = _cluster(data_dir)
    primary = cluster.primary()
    if primary is None:
        raise click.ClickException("no primary answers")
    timeline = (primary.state() or {}).get("timeline", 0)
    started = time.monotonic()
    primary.kill()
    click.echo(f"killed {primary.name} (timeline {timeline}); waiting for a new primary ...", err=True)
    new = cluster.wait_for_primary(120, after_timeline=timeline)
    click.echo(f"{new.name} is the primary, {time.monotonic() - started:.1f} s after the kill")
