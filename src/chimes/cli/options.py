"""Options every command shares; each has a CHIMES_* environment variable, shown in --help."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from chimes.settings import DEFAULT_HOST, DEFAULT_PORT, Settings, default_data_dir


def database_options(func: Callable[..., Any]) -> Callable[..., Any]:
    func = click.option(
        "--data-dir", envvar="CHIMES_DATA_DIR", show_envvar=True, type=click.Path(path_type=Path),
        default=default_data_dir(), show_default=True,
        help="Where the embedded PostgreSQL keeps its data (used when no database URL is given).",
    )(func)
    func = click.option(
        "--database-url", envvar="CHIMES_DATABASE_URL", show_envvar=True, default=None,
        help="PostgreSQL URL (14+). Without it, an embedded PostgreSQL is started in --data-dir.",
    )(func)
    return func


def listen_options(func: Callable[..., Any]) -> Callable[..., Any]:
    func = click.option("--port", envvar="CHIMES_PORT", show_envvar=True, type=click.IntRange(1, 65535),
                        default=DEFAULT_PORT, show_default=True, help="Port the API listens on.")(func)
    func = click.option("--host", envvar="CHIMES_HOST", show_envvar=True, default=DEFAULT_HOST,
                        show_default=True, help="Address the API listens on.")(func)
    return func


def settings_from(database_url: str | None, data_dir: Path, host: str = DEFAULT_HOST,
                  port: int = DEFAULT_PORT) -> Settings:
    return Settings(database_url=database_url or None, data_dir=data_dir, host=host, port=port)
