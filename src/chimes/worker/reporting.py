"""What a worker tells the outside about the outcomes it recorded: metrics, and a log line per failure."""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable

from chimes import metrics
from chimes.store.working import Outcome

log = logging.getLogger("chimes.worker")


def report_outcomes(batch: Iterable[Outcome], accepted: Collection[object]) -> None:
    """Called with each batch the database accepted (outcomes not in ``accepted`` changed nothing)."""
    batch = list(batch)
    metrics.record_outcomes(batch, set(accepted))
    for outcome in batch:
        if outcome.run.run_id in accepted and outcome.status == "failed":
            fields = {"run_id": str(outcome.run.run_id), "job_id": str(outcome.run.job_id),
                      "attempt": outcome.run.attempt}
            if outcome.retry_at is not None:
                log.info("run %s attempt %d failed, retrying at %s: %s", outcome.run.run_id, outcome.run.attempt,
                         outcome.retry_at.isoformat(), outcome.error, extra=fields)
            else:
                log.warning("run %s failed after attempt %d: %s", outcome.run.run_id, outcome.run.attempt,
                            outcome.error, extra=fields)
