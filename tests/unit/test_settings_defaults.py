"""Defaults are declared once, in chimes.settings; where SQL must repeat one as a literal, it agrees."""

from __future__ import annotations

import re
from pathlib import Path

import chimes.store.queries
from chimes import settings
from chimes.cli.main import cli
from chimes.jobs import JobSpec

MIGRATIONS = Path(chimes.store.queries.__file__).parent / "migrations"


def test_the_claim_function_falls_back_to_the_default_run_timeout() -> None:
    """The claim (migration 0002) sets a run's deadline from its job's timeout, or this default."""
    fallbacks = {int(n) for path in MIGRATIONS.glob("*.sql")
                 for n in re.findall(r"coalesce\(j\.timeout_sec,\s*(\d+)\)", path.read_text())}
    assert fallbacks == {settings.RUN_TIMEOUT_SEC}


def test_a_job_spec_without_a_timeout_gets_the_default() -> None:
    spec = JobSpec.model_validate({"name": "j", "schedule": {"cron": "* * * * *"},
                                   "task": {"type": "http", "url": "http://127.0.0.1:9/"}})
    assert spec.timeout_sec == settings.RUN_TIMEOUT_SEC
    assert spec.catch_up.window_sec == settings.CATCH_UP_WINDOW_SEC


def test_the_role_options_show_the_settings_defaults() -> None:
    def defaults(command: str) -> dict[str, object]:
        return {p.name: p.default for p in cli.commands[command].params if p.name}

    scheduler, worker, up = defaults("scheduler"), defaults("worker"), defaults("up")
    assert scheduler["lease_ttl"] == settings.PARTITION_LEASE_TTL_SEC
    assert scheduler["retention_days"] == settings.RETENTION_DAYS
    assert scheduler["missed_after"] == settings.MISSED_AFTER_SEC
    assert scheduler["notify_give_up_hours"] == settings.NOTIFY_GIVE_UP_HOURS
    assert scheduler["fire_ahead"] == settings.FIRE_AHEAD_SEC
    assert worker["lease_sec"] == settings.RUN_LEASE_SEC
    assert worker["shutdown_grace"] == settings.SHUTDOWN_GRACE_SEC
    assert worker["container_runtime"] == settings.CONTAINER_RUNTIME
    assert worker["concurrency"] == up["worker_concurrency"] == settings.WORKER_CONCURRENCY
