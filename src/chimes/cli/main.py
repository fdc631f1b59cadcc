"""``chimes``: one command, several roles (ARCHITECTURE.md), plus admin and client subcommands."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import click

from chimes import __version__, logs
from chimes.cli import client, tokens
from chimes.cli.importer import import_jobs
from chimes.cli.options import database_options, listen_options, settings_from
from chimes.cli.runtime import migrate_database, run_async
from chimes.store import db

log = logging.getLogger("chimes")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="chimes")
@click.option("--log-level", envvar="CHIMES_LOG_LEVEL", show_envvar=True, default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def cli(log_level: str) -> None:
    """Chimes: run work later, once or on a cron schedule, on time, with retries and history."""
    logs.configure(log_level)


@cli.command()
@database_options
@listen_options
@click.option("--worker-concurrency", envvar="CHIMES_WORKER_CONCURRENCY", show_envvar=True, default=100,
              show_default=True, type=click.IntRange(1, 10_000), help="Runs the built-in worker executes at once.")
def up(database_url: str | None, data_dir: Path, host: str, port: int, worker_concurrency: int) -> None:
    """Everything in one process: embedded PostgreSQL (unless --database-url), API, scheduler, worker."""
    from chimes.cli.roles import run_all_in_one

    settings = settings_from(database_url, data_dir, host, port)
    with db.database_url(settings) as dsn:
        run_async(lambda: run_all_in_one(dsn, settings, worker_concurrency))


@cli.command()
@database_options
@listen_options
def api(database_url: str | None, data_dir: Path, host: str, port: int) -> None:
    """The REST API. Stateless: run several behind a load balancer."""
    from chimes.cli.roles import run_api

    settings = settings_from(database_url, data_dir, host, port)
    with db.database_url(settings) as dsn:
        run_async(lambda: run_api(dsn, settings))


@cli.command()
@database_options
@click.option("--node-id", envvar="CHIMES_NODE_ID", show_envvar=True, default=None,
              help="Name of this node (default: host, pid and a random suffix).")
@click.option("--lease-ttl", envvar="CHIMES_LEASE_TTL", show_envvar=True, default=5.0, show_default=True,
              type=click.FloatRange(1, 300),
              help="Seconds a partition lease lasts unrenewed: how soon a dead node's partitions move.")
def scheduler(database_url: str | None, data_dir: Path, node_id: str | None, lease_ttl: float) -> None:
    """A scheduler node: leases a fair share of the 1,024 trigger partitions and fires their runs."""
    from chimes.cli.roles import run_scheduler

    with db.database_url(settings_from(database_url, data_dir)) as dsn:
        run_async(lambda: run_scheduler(dsn, node_id, lease_ttl))


@cli.command()
@database_options
@click.option("--concurrency", envvar="CHIMES_WORKER_CONCURRENCY", show_envvar=True, default=100,
              show_default=True, type=click.IntRange(1, 10_000), help="Runs executed at once.")
@click.option("--worker-id", envvar="CHIMES_WORKER_ID", show_envvar=True, default=None,
              help="Name of this worker (default: host, pid and a random suffix).")
@click.option("--lease-sec", envvar="CHIMES_RUN_LEASE_SEC", show_envvar=True, default=30.0, show_default=True,
              type=click.FloatRange(1, 3600),
              help="Seconds a run's lease lasts unrenewed: how soon a dead worker's runs are retried.")
@click.option("--shutdown-grace", envvar="CHIMES_SHUTDOWN_GRACE_SEC", show_envvar=True, default=30.0,
              show_default=True, type=click.FloatRange(0, 3600),
              help="On SIGTERM, seconds in-flight runs get to finish before they are handed back.")
def worker(database_url: str | None, data_dir: Path, concurrency: int, worker_id: str | None,
           lease_sec: float, shutdown_grace: float) -> None:
    """A worker: claims runs from the queue and executes them."""
    from chimes.cli.roles import run_worker

    with db.database_url(settings_from(database_url, data_dir)) as dsn:
        run_async(lambda: run_worker(dsn, concurrency, worker_id, lease_sec, shutdown_grace))


@cli.command()
@database_options
def migrate(database_url: str | None, data_dir: Path) -> None:
    """Apply pending schema migrations (chimes up does this by itself)."""
    with db.database_url(settings_from(database_url, data_dir)) as dsn:
        applied = asyncio.run(migrate_database(dsn))
    click.echo(f"applied migrations: {', '.join(map(str, applied))}" if applied else "schema is up to date")


cli.add_command(tokens.token)
cli.add_command(client.jobs)
cli.add_command(client.runs)
client.jobs.add_command(import_jobs)


def main() -> None:
    cli(prog_name="chimes")
