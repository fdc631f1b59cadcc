"""Options every command shares; each has a CHIMES_* environment variable, shown in --help."""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import click

from chimes import settings
from chimes.instants import in_utc
from chimes.settings import DEFAULT_HOST, DEFAULT_PORT, Settings, default_data_dir


def database_options(func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def with_connect_wait(*args: Any, database_wait: float, database_connect_timeout: float,
                          database_timeout: float | None, **kwargs: Any) -> Any:
        from chimes.store import db

        db.set_connect_wait(database_wait)
        db.set_timeouts(database_connect_timeout, database_timeout)
        return func(*args, **kwargs)

    command = click.option(
        "--database-timeout", envvar="CHIMES_DATABASE_TIMEOUT_SEC", show_envvar=True, type=click.FloatRange(min=0),
        default=None,
        help="Seconds one statement may take before the connection is treated as gone (0: no limit). Default: "
             "10 for the API, scheduler and worker; no limit for migrations, imports and admin commands.",
    )(with_connect_wait)
    command = click.option(
        "--database-connect-timeout", envvar="CHIMES_DATABASE_CONNECT_TIMEOUT_SEC", show_envvar=True,
        type=click.FloatRange(min=0.1), default=settings.DATABASE_CONNECT_TIMEOUT_SEC, show_default=True,
        help="Seconds to wait for each host of the database URL to accept a connection before trying the next.",
    )(command)

    command = click.option(
        "--database-wait", envvar="CHIMES_DATABASE_WAIT_SEC", show_envvar=True, type=click.FloatRange(min=0),
        default=settings.DATABASE_WAIT_SEC, show_default=True,
        help="Seconds to keep trying a database that is starting, recovering or full before giving up.",
    )(command)
    command = click.option(
        "--data-dir", envvar="CHIMES_DATA_DIR", show_envvar=True, type=click.Path(path_type=Path),
        default=default_data_dir(), show_default=True,
        help="Where the embedded PostgreSQL keeps its data (used when no database URL is given).",
    )(command)
    return click.option(
        "--database-url", envvar="CHIMES_DATABASE_URL", show_envvar=True, default=None,
        help="PostgreSQL URL (14+). Without it, an embedded PostgreSQL is started in --data-dir.",
    )(command)


def listen_options(func: Callable[..., Any]) -> Callable[..., Any]:
    func = click.option("--port", envvar="CHIMES_PORT", show_envvar=True, type=click.IntRange(1, 65535),
                        default=DEFAULT_PORT, show_default=True, help="Port the API listens on.")(func)
    func = click.option("--host", envvar="CHIMES_HOST", show_envvar=True, default=DEFAULT_HOST,
                        show_default=True, help="Address the API listens on.")(func)
    return func


def settings_from(database_url: str | None, data_dir: Path, host: str = DEFAULT_HOST,
                  port: int = DEFAULT_PORT) -> Settings:
    return Settings(database_url=database_url or None, data_dir=data_dir, host=host, port=port)


def metrics_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--metrics-port``/``--metrics-host`` for the scheduler and worker roles: when a port is given,
    Prometheus metrics are served on it (``/metrics``) from a background thread before the role starts."""

    @functools.wraps(func)
    def serve_then_run(*args: Any, metrics_port: int | None, metrics_host: str, **kwargs: Any) -> Any:
        if metrics_port is not None:
            from chimes import metrics

            try:
                metrics.serve(metrics_port, metrics_host)
            except OSError as exc:
                raise click.BadParameter(f"cannot listen on {metrics_host}:{metrics_port}: {exc.strerror or exc}",
                                         param_hint="--metrics-port") from None
        return func(*args, **kwargs)

    serve_then_run = click.option(
        "--metrics-host", envvar="CHIMES_METRICS_HOST", show_envvar=True, default="0.0.0.0", show_default=True,
        help="Address the metrics port listens on.")(serve_then_run)
    serve_then_run = click.option(
        "--metrics-port", envvar="CHIMES_METRICS_PORT", show_envvar=True, default=None,
        type=click.IntRange(1, 65535), help="Serve Prometheus metrics on this port (default: not served).",
    )(serve_then_run)
    return serve_then_run


def aware_time(context: click.Context, param: click.Parameter, value: str | None) -> datetime | None:
    """A click callback for an option that takes a time: ISO 8601 with a zone, in UTC."""
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an ISO 8601 time such as 2026-12-04T05:00:00Z") from None
    if moment.tzinfo is None:
        raise click.BadParameter(f"{value!r} has no time zone: add Z (UTC) or an offset such as +01:00")
    try:
        return in_utc(moment)
    except ValueError as exc:
        raise click.BadParameter(f"{value!r} {exc}") from None
