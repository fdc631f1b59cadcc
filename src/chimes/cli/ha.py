"""``chimes ha``: Chimes on a highly available PostgreSQL (Patroni and etcd) on this machine.

To try a failover, test against one, or measure one; production runs the same pieces on several
hosts (docs/high-availability.md).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import click

from chimes.cli.options import aware_time, listen_options, settings_from
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


def _cluster(data_dir: Path, members: int = 3, backup_repo: Path | None = None, backup_tool: str | None = None) -> Any:
    from chimes.ha.cluster import BackupTool, HaCluster

    try:
        return HaCluster(data_dir.expanduser() / "ha", postgres=members, backup_repo=backup_repo,
                         backup_tool=None if backup_tool is None else BackupTool(backup_tool))
    except ValueError as exc:  # a repository path that cannot go into archive_command
        raise click.BadParameter(str(exc), param_hint="--backup-repo") from None



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
@click.option("--backup-repo", envvar="CHIMES_HA_BACKUP_REPO", show_envvar=True, type=click.Path(path_type=Path),
              default=None,
              help="Archive every member's WAL into this repository, where chimes ha backup takes base backups and "
                   "chimes ha restore restores from; remembered in ha.json.")
@click.option("--backup-tool", envvar="CHIMES_HA_BACKUP_TOOL", show_envvar=True,
              type=click.Choice(["postgres", "pgbackrest"]), default=None,
              help="postgres: PostgreSQL's own tools (archive_command, pg_basebackup, pg_verifybackup); pgbackrest: "
                   "pgBackRest, where its version supports the server's PostgreSQL. Default: as ha.json says, "
                   "else postgres; remembered in ha.json.")
@listen_options
@api_security_options
@worker_security_options
@egress_loopback_option(default=True)
@allow_commands_option(default=True)
@key_file_option
def up(data_dir: Path, members: int, rejoin_after: float, worker_concurrency: int, backup_repo: Path | None,
       backup_tool: str | None, host: str, port: int, **security: Any) -> None:
    """etcd (3 members), PostgreSQL under Patroni in synchronous mode, and the API, a scheduler node
    and a worker on it, in one command. Kill the primary (chimes ha kill-primary) and watch the jobs go on."""
    from chimes.cli.roles import run_all_in_one
    from chimes.ha.runtime import HaUnavailable

    cluster = _cluster(data_dir, members, backup_repo, backup_tool)
    if backup_tool is not None and cluster.layout.backup_repo is None:
        raise click.BadParameter("there is no backup repository to archive into: give --backup-repo too",
                                 param_hint="--backup-tool")
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
@click.option("--keep", envvar="CHIMES_HA_BACKUP_KEEP", show_envvar=True, type=click.IntRange(1), default=None,
              help="PostgreSQL's tools: once the new backup is verified, remove all but the KEEP newest verified base "
                   "backups and the archived WAL only the removed ones needed.  [default: 2]")
@click.option("--type", "kind", type=click.Choice(["full", "diff", "incr"]), default=None,
              help="pgBackRest: full, everything; diff, what changed since the last full; incr (the default), since "
                   "the last backup of any type. PostgreSQL's tools take full base backups only.")
def backup(data_dir: Path, keep: int | None, kind: str | None) -> None:
    """A base backup of the cluster (started with --backup-repo), taken from a streaming standby when
    there is one. With PostgreSQL's tools: pg_basebackup, then pg_verifybackup (a backup that fails is
    kept as base/<time>.failed, does not count, and the command fails), then retention. With
    pgBackRest: pgbackrest backup, then pgbackrest info. Run it on a schedule (cron, a systemd timer)."""
    from chimes.ha.base_backup import BackupFailed, take
    from chimes.ha.repository import KEEP
    from chimes.ha.runtime import HaUnavailable

    cluster = _cluster(data_dir)
    if cluster.pgbackrest is not None:
        if keep is not None:
            raise click.BadParameter("pgBackRest keeps what its repo1-retention-full says", param_hint="--keep")
        try:
            click.echo(cluster.pgbackrest.backup(kind or "incr", cluster.layout.superuser_password))
        except HaUnavailable as exc:
            raise click.ClickException(str(exc)) from None
        return
    if kind not in (None, "full"):
        raise click.BadParameter("PostgreSQL's tools take full base backups only", param_hint="--type")
    try:
        taken = take(cluster, KEEP if keep is None else keep)
    except BackupFailed as exc:
        raise click.ClickException(str(exc)) from None
    made = taken.backup
    click.echo(f"base backup {made.folder} from {made.member} ({taken.role}), {made.started.isoformat()} to "
               f"{made.finished.isoformat()}, verified; it restores to any time from {made.finished.isoformat()} "
               f"on, as far as the archived WAL goes")
    if taken.retention.remove or taken.wal_files_removed:
        click.echo(f"removed {len(taken.retention.remove)} older base backups "
                   f"({', '.join(b.name for b in taken.retention.remove) or 'none'}) and "
                   f"{taken.wal_files_removed} archived WAL files before {taken.retention.first_wal_kept}")


@ha.command()
@data_dir_option
@click.option("--to-time", envvar="CHIMES_HA_RESTORE_TO_TIME", show_envvar=True, required=True, callback=aware_time,
              help="Restore the cluster as it was at this time (ISO 8601 with a zone): every transaction committed "
                   "by then, none after.")
@click.option("--timeout", "timeout_sec", envvar="CHIMES_HA_RESTORE_TIMEOUT_SEC", show_envvar=True,
              type=click.FloatRange(1), default=3600.0, show_default=True,
              help="Seconds the copy and the replay may take before the restore gives up (and undoes itself).")
def restore(data_dir: Path, to_time: datetime, timeout_sec: float) -> None:
    """Rebuild the stopped cluster as it was at --to-time, from the newest verified base backup
    finished by then and the archived WAL, through Patroni's custom bootstrap. Any failure, replay
    that falls short of the time included, leaves the cluster as it was. Then start it: chimes ha up."""
    from chimes.ha.restore import RestoreFailed, restore_cluster
    from chimes.ha.runtime import HaUnavailable

    cluster = _cluster(data_dir)
    try:
        done = restore_cluster(cluster, to_time, timeout_sec=timeout_sec, say=lambda line: click.echo(line, err=True))
    except (RestoreFailed, HaUnavailable) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"restored the cluster in {cluster.base} from base backup {done.backup.name} in {done.seconds:.1f} s; "
               f"replay: {done.reached}")
    click.echo(f"{done.member} is the leader: start the cluster with chimes ha up --data-dir {data_dir} (the other "
               f"members are made its standbys), then take a base backup of the new timeline (chimes ha backup)")
    if done.set_aside:
        click.echo("the data directories of before are kept, to delete once the restore is checked: "
                   + ", ".join(str(path) for path in done.set_aside))


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
