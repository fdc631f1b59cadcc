"""The lease reaper: ends attempts whose worker vanished (lease expired) or overran its deadline.

A lost attempt is re-enqueued at once with the attempt number raised, as the run never got a fair
try; an overrun counts as a failed attempt and follows the retry policy's backoff. Either way, a run
with no attempts left fails for good, with the reason recorded.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime

from chimes import failures, metrics
from chimes.backoff import DEFAULT_POLICY, plan_retry
from chimes.enums import RunStatus
from chimes.store.scheduling import ExpiredRun, LostRun, SchedulerStore

log = logging.getLogger(__name__)
POISON_AFTER = 3  # lease losses (worker deaths) after which a run is failed as poison


def judge(run: ExpiredRun, now: datetime, poison_after: int = POISON_AFTER) -> LostRun:
    """Decide how one expired run ends. Pure: ``now`` is passed in."""
    policy = run.retry_policy or DEFAULT_POLICY
    attempt = run.attempt
    lease_lost = bool(run.lease_expired)
    if lease_lost:
        error = f"worker {run.worker_id} stopped heartbeating during attempt {attempt} (lease expired)"
        retry = plan_retry(policy, attempt, now, run.scheduled_at, delay_sec=0.0)  # at once: no fair try
        losses = (run.lease_losses or 0) + 1
        if losses >= poison_after:
            # The run itself probably kills its workers (memory, a crash in a library): stop feeding it.
            return _lost(run, f"{error}; poison run: its workers died {losses} times", None)
    else:
        error = f"attempt {attempt} ran past its deadline and was abandoned"
        retry = plan_retry(policy, attempt, now, run.scheduled_at)
    retry_at = retry.at
    if retry.past_deadline:
        error += f"; {retry.past_deadline}"
    elif retry_at is None:
        error += "; no attempts left"
    return _lost(run, error, retry_at, lease_lost)


def _lost(run: ExpiredRun, error: str, retry_at: datetime | None, lease_lost: bool = True) -> LostRun:
    return LostRun(run_id=run.run_id, scheduled_at=run.scheduled_at, lease_token=run.lease_token,
                   worker_id=run.worker_id, started_at=run.started_at, error=error, retry_at=retry_at,
                   lease_lost=lease_lost)


def _judge_or_fail(run: ExpiredRun, now: datetime) -> LostRun:
    """A run whose stored retry policy cannot be read fails for good, saying why, instead of
    stopping the reaper for every run behind it."""
    try:
        return judge(run, now)
    except Exception as exc:
        failures.set_aside("scheduler", "expired_run", f"expired run {run.run_id}", exc)
        return _lost(run, f"the run could not be judged after its attempt ended ({failures.describe(exc)})", None)


class Reaper:
    def __init__(self, store: SchedulerStore, batch_size: int = 1000, reconcile_every: int = 5) -> None:
        self.store = store
        self.batch_size = batch_size
        self.reaped = 0
        self._sweeps = 0
        self._reconcile_every = reconcile_every

    async def sweep(self, leases: Mapping[int, int], now: datetime) -> int:
        """Reap what is expired in the held partitions; returns how many runs were ended or re-enqueued."""
        if not leases:
            return 0
        self._sweeps += 1
        if self._sweeps % self._reconcile_every == 0:
            await self.store.reconcile_active_runs()
            await self.store.forget_dead_claims()
        rows = await self.store.expired_runs(list(leases), self.batch_size)
        if not rows:
            return 0
        ended = await self.store.reap(leases, [_judge_or_fail(r, now) for r in rows], now)
        for row in ended:
            log.warning("reaped run %s (%s)", row["run_id"],
                        "re-enqueued" if row["retry_at"] is not None else RunStatus.FAILED,
                        extra={"run_id": str(row["run_id"]), "job_id": str(row["job_id"])})
        metrics.record_reaped(ended)
        self.reaped += len(ended)
        return len(ended)
