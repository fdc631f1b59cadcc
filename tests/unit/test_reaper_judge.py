"""Tests for chimes.scheduler.reaper.judge: how an expired or overrun run attempt ends."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from chimes.scheduler.reaper import judge
from chimes.store.scheduling import ExpiredRun, LostRun

NOW = datetime(2026, 4, 1, 8, 30, tzinfo=UTC)
SCHEDULED = datetime(2026, 4, 1, 8, 0, tzinfo=UTC)
STARTED = datetime(2026, 4, 1, 8, 0, 1, tzinfo=UTC)
FLAT = {"maxAttempts": 4, "initialBackoffSec": 10, "multiplier": 3, "maxBackoffSec": 60, "jitter": 0}


def row(attempt: int, lease_expired: bool, retry_policy: dict | None = FLAT, worker: str | None = "w-17",
        lease_losses: int | None = 0) -> ExpiredRun:
    return ExpiredRun(run_id=uuid.UUID(int=42), scheduled_at=SCHEDULED, job_id=uuid.UUID(int=3), attempt=attempt,
                      lease_token=uuid.UUID(int=7), partition_id=5, priority=1, worker_id=worker, started_at=STARTED,
                      job_version=1, deadline_at=None, lease_losses=lease_losses, lease_expired=lease_expired,
                      retry_policy=retry_policy)


def test_carries_the_run_identity() -> None:
    lost = judge(row(1, True), NOW)
    assert isinstance(lost, LostRun)
    assert (lost.run_id, lost.scheduled_at, lost.lease_token, lost.worker_id, lost.started_at) == (
        uuid.UUID(int=42), SCHEDULED, uuid.UUID(int=7), "w-17", STARTED)


@pytest.mark.parametrize("attempt", [1, 2, 3])
def test_lease_expired_with_attempts_left_retries_at_once(attempt: int) -> None:
    lost = judge(row(attempt, True), NOW)
    assert lost.retry_at == NOW
    assert "worker w-17 stopped heartbeating" in lost.error
    assert f"attempt {attempt}" in lost.error
    assert "no attempts left" not in lost.error


@pytest.mark.parametrize("attempt", [4, 5])
def test_lease_expired_with_no_attempts_left_fails(attempt: int) -> None:
    lost = judge(row(attempt, True), NOW)
    assert lost.retry_at is None
    assert "worker w-17 stopped heartbeating" in lost.error
    assert "no attempts left" in lost.error


@pytest.mark.parametrize(
    ("attempt", "retry_at"),
    [
        (1, NOW + timedelta(seconds=10)),
        (2, NOW + timedelta(seconds=30)),
        (3, NOW + timedelta(seconds=60)),  # 90 capped at 60
        (4, None),
        (9, None),
    ],
)
def test_deadline_overrun_follows_backoff(attempt: int, retry_at: datetime | None) -> None:
    lost = judge(row(attempt, False), NOW)
    assert lost.retry_at == retry_at
    assert f"attempt {attempt} ran past its deadline" in lost.error
    assert "stopped heartbeating" not in lost.error
    assert ("no attempts left" in lost.error) == (retry_at is None)


@pytest.mark.parametrize(
    ("attempt", "lease_expired", "retries"),
    [(1, True, True), (2, True, True), (3, True, False), (1, False, True), (2, False, True), (3, False, False)],
)
def test_missing_policy_uses_default_three_attempts(attempt: int, lease_expired: bool, retries: bool) -> None:
    lost = judge(row(attempt, lease_expired, retry_policy=None), NOW)
    assert (lost.retry_at is not None) == retries
    if retries and lease_expired:
        assert lost.retry_at == NOW
    if retries and not lease_expired:  # default backoff: 1 s * 2^(n-1), jitter 20 %
        base = 2 ** (attempt - 1)
        assert NOW + timedelta(seconds=base * 0.8) <= lost.retry_at <= NOW + timedelta(seconds=base * 1.2)


def test_lease_expired_without_max_attempts_key_defaults_to_three() -> None:
    policy = {"jitter": 0}
    assert judge(row(2, True, policy), NOW).retry_at == NOW
    assert judge(row(3, True, policy), NOW).retry_at is None


@pytest.mark.parametrize("lease_expired", [True, False])
def test_a_retry_past_max_duration_is_not_made_and_the_reason_recorded(lease_expired: bool) -> None:
    policy = FLAT | {"maxDurationSec": 600}  # NOW is 30 minutes after SCHEDULED
    lost = judge(row(1, lease_expired, policy), NOW)
    assert lost.retry_at is None
    assert "retryPolicy.maxDurationSec (600 s" in lost.error and "no attempts left" not in lost.error
    assert judge(row(1, lease_expired, FLAT | {"maxDurationSec": 3600}), NOW).retry_at is not None
