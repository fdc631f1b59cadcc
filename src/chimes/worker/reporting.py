"""What a worker tells the outside about the outcomes it recorded: metrics, and a log line per failure."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable

from chimes import metrics
from chimes.enums import RunStatus
from chimes.store.working import Completion

log = logging.getLogger("chimes.worker")


def report_outcomes(batch: Iterable[Completion], accepted: Collection[object]) -> None:
    """Called with each batch the database accepted (outcomes not in ``accepted`` changed nothing)."""
    batch = list(batch)
    metrics.record_outcomes(batch, set(accepted))
    for done in batch:
        run, error = done.run, done.outcome.error
        if run.run_id in accepted and done.outcome.status is RunStatus.FAILED:
            fields = {"run_id": str(run.run_id), "job_id": str(run.job_id), "attempt": run.attempt}
            if done.retry_at is not None:
                log.info("run %s attempt %d failed, retrying at %s: %s", run.run_id, run.attempt,
                         done.retry_at.isoformat(), error, extra=fields)
            else:
                log.warning("run %s failed after attempt %d: %s", run.run_id, run.attempt, error, extra=fields)
