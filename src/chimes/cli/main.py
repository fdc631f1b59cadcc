"""``chimes``: one command, several roles (ARCHITECTURE.md), plus admin and client subcommands."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import click

from chimes import __version__, logs, tracing
from chimes.cli import apply, audit, backup, caps, chaos, client, config, ha, owners, shards, tokens, upgrades
from chimes.cli.importer import import_jobs
from chimes.cli.options import database_options, listen_options, metrics_options, settings_from
from chimes.cli.runtime import run_async
from chimes.cli.security_options import (
    allow_commands_option,
    api_security,
    api_security_options,
    egress_loopback_option,
    key_file_option,
    owner_share_option,
    worker_security,
    worker_security_options,
)
from chimes.settings import (
    CONTAINER_RUNTIME,
    FIRE_AHEAD_SEC,
    MISSED_AFTER_SEC,
    NOTIFY_GIVE_UP_HOURS,
    PARTITION_LEASE_TTL_SEC,
    RETENTION_DAYS,
    RUN_LEASE_SEC,
    SHUTDOWN_GRACE_SEC,
    WORKER_CONCURRENCY,
)
from chimes.store import db
from chimes.store.embedded import ARCHIVE_TIMEOUT_SEC, Archiving, ServerInUse
from chimes.store.migrate import ReleaseTooOld

log = logging.getLogger("chimes")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="chimes")
@click.option("--log-level", envvar="CHIMES_LOG_LEVEL", show_envvar=True, default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.option("--log-format", envvar="CHIMES_LOG_FORMAT", show_envvar=True, default="auto", show_default=True,
              type=click.Choice(logs.FORMATS), help="auto: JSON lines unless stderr is a terminal.")
def cli(log_level: str, log_format: str) -> None:
    """Chimes: run work later, once or on a cron schedule, on time, with retries and history."""
    logs.configure(log_level, log_format)
    tracing.configure_from_env()  # off unless OTEL_* asks for traces


@cli.command()
@database_options
@listen_options
@click.option("--worker-concurrency", envvar="CHIMES_WORKER_CONCURRENCY", show_envvar=True, default=WORKER_CONCURRENCY,
              show_default=True, type=click.IntRange(1, 10_000), help="Runs the built-in worker executes at once.")
@api_security_options
@worker_security_options
@egress_loopback_option(default=True)  # the README's tour calls a target on 127.0.0.1
@allow_commands_option(default=True)  # one person on their own machine: the README's tour runs commands
@owner_share_option
@key_file_option
@click.option("--backup-dir", envvar="CHIMES_BACKUP_DIR", show_envvar=True, type=click.Path(path_type=Path),
              default=None, help="Archive the embedded PostgreSQL's WAL into BACKUP_DIR/wal, for chimes backup and "
                                 "chimes restore (point-in-time). Without it, archiving is off.")
@click.option("--archive-timeout", envvar="CHIMES_ARCHIVE_TIMEOUT_SEC", show_envvar=True,
              default=ARCHIVE_TIMEOUT_SEC, show_default=True, type=click.IntRange(1, 86400),
              help="Seconds after which a WAL segment with commits in it is archived even if not full: the most "
                   "work a lost disk can take with it.")
@click.option("--processes/--single-process", "processes", envvar="CHIMES_UP_PROCESSES", show_envvar=True,
              default=False, show_default=True,
              help="Run the scheduler and the worker as child processes this one supervises, instead of in this "
                   "process's event loop (docs/operations.md, \"How chimes up runs its roles\").")
@click.option("--worker-processes", envvar="CHIMES_UP_WORKER_PROCESSES", show_envvar=True, default=1,
              show_default=True, type=click.IntRange(1, 64),
              help="With --processes: this many worker processes, sharing --worker-concurrency out among them.")
def up(database_url: str | None, data_dir: Path, host: str, port: int, worker_concurrency: int,
       backup_dir: Path | None, archive_timeout: int, processes: bool, worker_processes: int,
       **security: Any) -> None:
    """Everything with one command: embedded PostgreSQL (unless --database-url), API, scheduler and worker
    in one process (or the scheduler and the worker as supervised child processes with --processes)."""
    from chimes.cli.role_processes import role_commands
    from chimes.cli.roles import run_all_in_one, run_up

    if database_url and backup_dir is not None:
        raise click.BadParameter("archives the embedded PostgreSQL's WAL; back up a PostgreSQL of your own with its "
                                 "own tools (pgBackRest: docs/high-availability.md)", param_hint="--backup-dir")
    try:
        archiving = Archiving(backup_dir, archive_timeout)
        archiving.conf()
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--backup-dir") from None
    if worker_processes > 1 and not processes:
        raise click.BadParameter("runs workers as child processes: add --processes", param_hint="--worker-processes")
    if worker_processes > worker_concurrency:
        raise click.BadParameter(f"{worker_processes} worker processes need a --worker-concurrency of at least "
                                 f"{worker_processes} (one run each), not {worker_concurrency}",
                                 param_hint="--worker-processes")
    settings = settings_from(database_url, data_dir, host, port)
    api_settings, worker_settings = api_security(data_dir, security), worker_security(data_dir, security)
    with db.database_url(settings, None if database_url else archiving) as dsn:
        if not processes:
            run_async(lambda: run_all_in_one(dsn, settings, worker_concurrency, api_settings, worker_settings))
            return
        context = click.get_current_context()
        children = role_commands(context.find_root(), context.params, dsn, worker_processes)
        run_async(lambda: run_up(dsn, settings, children, _stop_wait_sec(), api_settings, worker_settings))


def _stop_wait_sec() -> float:
    """How long ``chimes up`` waits for its children on SIGTERM before it kills them: the worker's
    shutdown grace (its option's variable, as the child reads it) and time to hand its runs back."""
    return float(os.environ.get("CHIMES_SHUTDOWN_GRACE_SEC") or SHUTDOWN_GRACE_SEC) + 30


@cli.command()
@database_options
@listen_options
@api_security_options
@key_file_option
def api(database_url: str | None, data_dir: Path, host: str, port: int, **security: Any) -> None:
    """The REST API. Stateless: run several behind a load balancer."""
    from chimes.cli.roles import run_api

    settings = settings_from(database_url, data_dir, host, port)
    api_settings = api_security(data_dir, security)
    with db.database_url(settings) as dsn:
        run_async(lambda: run_api(dsn, settings, api_settings))


@cli.command()
@metrics_options
@database_options
@click.option("--node-id", envvar="CHIMES_NODE_ID", show_envvar=True, default=None,
              help="Name of this node (default: host, pid and a random suffix).")
@click.option("--lease-ttl", envvar="CHIMES_LEASE_TTL", show_envvar=True, default=PARTITION_LEASE_TTL_SEC,
              show_default=True,
              type=click.FloatRange(1, 300),
              help="Seconds a partition lease lasts unrenewed: how soon a dead node's partitions move.")
@click.option("--retention-days", envvar="CHIMES_RETENTION_DAYS", show_envvar=True, default=RETENTION_DAYS,
              show_default=True,
              type=click.IntRange(1, 3650), help="Run history older than this is dropped, a day at a time.")
@click.option("--missed-after", envvar="CHIMES_MISSED_AFTER_SEC", show_envvar=True, default=MISSED_AFTER_SEC,
              show_default=True, type=click.FloatRange(5, 86400),
              help="Seconds late after which a slot counts as missed and follows the job's catch-up policy.")
@click.option("--notify-give-up-hours", envvar="CHIMES_NOTIFY_GIVE_UP_HOURS", show_envvar=True,
              default=NOTIFY_GIVE_UP_HOURS,
              show_default=True, type=click.FloatRange(0.01, 24 * 365),
              help="A notification its webhook has not accepted this long after it was queued is dead-lettered.")
@click.option("--fire-ahead", envvar="CHIMES_FIRE_AHEAD_SEC", show_envvar=True, default=FIRE_AHEAD_SEC,
              show_default=True, type=click.FloatRange(0, 2),
              help="Seconds before an instant of 500 triggers or more its fire may begin (committed at the "
                   "instant; at most half of --lease-ttl). 0: every instant fires at its time.")
@worker_security_options  # a node sends the failure webhooks: the same egress policy, signed with the key
@egress_loopback_option(default=False)
@key_file_option
def scheduler(database_url: str | None, data_dir: Path, node_id: str | None, lease_ttl: float, retention_days: int,
              missed_after: float, notify_give_up_hours: float, fire_ahead: float, **security: Any) -> None:
    """A scheduler node: leases a fair share of the 1,024 trigger partitions and fires their runs."""
    from chimes.cli.roles import run_scheduler

    outgoing = worker_security(data_dir, security)
    with db.database_url(settings_from(database_url, data_dir)) as dsn:
        run_async(lambda: run_scheduler(dsn, node_id, lease_ttl, retention_days, missed_after, outgoing,
                                                notify_give_up_sec=notify_give_up_hours * 3600,
                                                fire_ahead_sec=fire_ahead))


@cli.command()
@metrics_options
@database_options
@click.option("--concurrency", envvar="CHIMES_WORKER_CONCURRENCY", show_envvar=True, default=WORKER_CONCURRENCY,
              show_default=True, type=click.IntRange(1, 10_000), help="Runs executed at once.")
@click.option("--worker-id", envvar="CHIMES_WORKER_ID", show_envvar=True, default=None,
              help="Name of this worker (default: host, pid and a random suffix).")
@click.option("--lease-sec", envvar="CHIMES_RUN_LEASE_SEC", show_envvar=True, default=RUN_LEASE_SEC,
              show_default=True,
              type=click.FloatRange(1, 3600),
              help="Seconds a run's lease lasts unrenewed: how soon a dead worker's runs are retried.")
@click.option("--shutdown-grace", envvar="CHIMES_SHUTDOWN_GRACE_SEC", show_envvar=True, default=SHUTDOWN_GRACE_SEC,
              show_default=True, type=click.FloatRange(0, 3600),
              help="On SIGTERM, seconds in-flight runs get to finish before they are handed back.")
@click.option("--container-runtime", envvar="CHIMES_CONTAINER_RUNTIME", show_envvar=True, default=CONTAINER_RUNTIME,
              show_default=True, help="Command that runs container tasks: docker, podman, nerdctl (with arguments).")
@worker_security_options
@egress_loopback_option(default=False)  # a team's task must not read the worker host's own services
@allow_commands_option(default=False)
@owner_share_option
@key_file_option
def worker(database_url: str | None, data_dir: Path, concurrency: int, worker_id: str | None,
           lease_sec: float, shutdown_grace: float, container_runtime: str, **security: Any) -> None:
    """A worker: claims runs from the queue and executes them."""
    from chimes.cli.roles import run_worker
    from chimes.worker.tasks.dispatch import Executors

    worker_settings = worker_security(data_dir, security)
    def executors() -> Executors:
        return Executors(container_runtime=container_runtime, egress=worker_settings.egress)

    try:
        executors()  # a runtime that cannot be used is a start-up error
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--container-runtime") from None
    with db.database_url(settings_from(database_url, data_dir)) as dsn:
        run_async(lambda: run_worker(dsn, concurrency, worker_id, lease_sec, shutdown_grace, executors,
                                     worker_settings))


cli.add_command(upgrades.migrate)
cli.add_command(tokens.token)
cli.add_command(config.config)
cli.add_command(caps.cap)
cli.add_command(chaos.chaos)
cli.add_command(ha.ha)
cli.add_command(backup.backup)
cli.add_command(backup.restore)
cli.add_command(owners.owner)
cli.add_command(shards.shards)
cli.add_command(client.jobs)
cli.add_command(client.runs)
cli.add_command(client.cron_group)
cli.add_command(client.calendars)
cli.add_command(apply.apply_jobs)
cli.add_command(audit.audit)
cli.add_command(apply.export_jobs)
client.jobs.add_command(import_jobs)


def main() -> None:
    try:
        cli(prog_name="chimes")
    except (db.DatabaseUnavailable, ReleaseTooOld, ServerInUse) as exc:  # unavailable: after the wait
        click.echo(f"Error: {exc}", err=True)
        raise SystemExit(1) from None
