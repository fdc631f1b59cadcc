"""Tests for chimes.backoff: exponential delays, jitter bounds and when retries run out."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from chimes.backoff import DEFAULT_POLICY, Retry, backoff_sec, next_attempt_at, plan_retry

NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)
FLAT = {"jitter": 0}


@pytest.mark.parametrize(
    ("policy", "failed_attempt", "expected"),
    [
        (FLAT, 1, 1.0),  # defaults: initial 1, multiplier 2, max 300
        (FLAT, 2, 2.0),
        (FLAT, 3, 4.0),
        (FLAT, 9, 256.0),
        (FLAT, 10, 300.0),  # 512 capped
        (FLAT, 50, 300.0),
        ({"jitter": 0, "initialBackoffSec": 5, "multiplier": 3}, 1, 5.0),
        ({"jitter": 0, "initialBackoffSec": 5, "multiplier": 3}, 3, 45.0),
        ({"jitter": 0, "initialBackoffSec": 5, "multiplier": 3, "maxBackoffSec": 40}, 3, 40.0),
        ({"jitter": 0, "initialBackoffSec": 0.5, "multiplier": 1}, 7, 0.5),
        ({"jitter": 0, "initialBackoffSec": 10, "maxBackoffSec": 10}, 1, 10.0),
    ],
)
def test_backoff_without_jitter(policy: dict, failed_attempt: int, expected: float) -> None:
    assert backoff_sec(policy, failed_attempt) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("policy", "failed_attempt", "low", "high"),
    [
        ({"jitter": 0.2}, 1, 0.8, 1.2),
        ({"jitter": 0.5, "initialBackoffSec": 10}, 2, 10.0, 30.0),
        ({"jitter": 1.0, "initialBackoffSec": 4}, 1, 0.0, 8.0),
        ({"jitter": 0.2}, 20, 240.0, 300.0),  # capped: upward jitter clipped to max
    ],
)
def test_jitter_stays_in_bounds(policy: dict, failed_attempt: int, low: float, high: float) -> None:
    rng = random.Random(7)
    delays = [backoff_sec(policy, failed_attempt, rng) for _ in range(2000)]
    assert all(low <= d <= high for d in delays)
    assert max(delays) - min(delays) > (high - low) * 0.5  # jitter actually spreads


def test_jitter_is_reproducible_with_seeded_rng() -> None:
    policy = {"jitter": 0.3, "initialBackoffSec": 2}
    first = [backoff_sec(policy, n, random.Random(42)) for n in range(1, 6)]
    again = [backoff_sec(policy, n, random.Random(42)) for n in range(1, 6)]
    assert first == again
    assert first != [2.0, 4.0, 8.0, 16.0, 32.0]


@pytest.mark.parametrize(
    ("policy", "failed_attempt", "expected"),
    [
        ({"maxAttempts": 3, "jitter": 0}, 1, NOW + timedelta(seconds=1)),
        ({"maxAttempts": 3, "jitter": 0}, 2, NOW + timedelta(seconds=2)),
        ({"maxAttempts": 3, "jitter": 0}, 3, None),
        ({"maxAttempts": 3, "jitter": 0}, 4, None),
        ({"maxAttempts": 1, "jitter": 0}, 1, None),
        ({"maxAttempts": 5, "jitter": 0, "initialBackoffSec": 30}, 4, NOW + timedelta(seconds=240)),
        ({"maxAttempts": 5, "jitter": 0, "initialBackoffSec": 30}, 5, None),
        ({"jitter": 0}, 2, NOW + timedelta(seconds=2)),  # maxAttempts defaults to 3
        ({"jitter": 0}, 3, None),
    ],
)
def test_next_attempt_at(policy: dict, failed_attempt: int, expected: datetime | None) -> None:
    assert next_attempt_at(policy, failed_attempt, NOW) == expected


@pytest.mark.parametrize("policy", [None, {}])
def test_missing_policy_uses_defaults(policy: dict | None) -> None:
    assert DEFAULT_POLICY["maxAttempts"] == 3
    first = next_attempt_at(policy, 1, NOW)
    assert first is not None
    assert NOW + timedelta(seconds=0.8) <= first <= NOW + timedelta(seconds=1.2)
    assert next_attempt_at(policy, 2, NOW) is not None
    assert next_attempt_at(policy, 3, NOW) is None


def test_max_duration_stops_retries_that_would_start_past_it() -> None:
    policy = {"maxAttempts": 10, "initialBackoffSec": 10, "multiplier": 2, "jitter": 0, "maxDurationSec": 60}
    since = NOW - timedelta(seconds=30)
    # 30 s in, a 10 s backoff starts at 40 s: within the 60 s.
    assert plan_retry(policy, 1, NOW, since) == Retry(NOW + timedelta(seconds=10))
    # 30 s in, a 40 s backoff would start at 70 s: none, and the reason says why.
    stopped = plan_retry(policy, 3, NOW, since)
    assert stopped.at is None and "retryPolicy.maxDurationSec (60 s" in (stopped.past_deadline or "")
    assert next_attempt_at(policy, 3, NOW, since) is None
    # Without the start time, or without the limit, only maxAttempts counts.
    assert plan_retry(policy, 3, NOW).at == NOW + timedelta(seconds=40)
    assert plan_retry({**policy, "maxDurationSec": None}, 3, NOW, since).at == NOW + timedelta(seconds=40)
    # Attempts exhausted is not a deadline.
    assert plan_retry(policy, 10, NOW, since) == Retry(None)
