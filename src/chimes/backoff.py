"""Retry timing: exponential backoff with jitter, from a job's retry policy."""

from __future__ import annotations

import random
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

DEFAULT_POLICY = {"maxAttempts": 3, "initialBackoffSec": 1.0, "maxBackoffSec": 300.0, "multiplier": 2.0,
                  "jitter": 0.2}


def backoff_sec(policy: Mapping[str, Any], failed_attempt: int, rand: random.Random | None = None) -> float:
    """Delay before the attempt after ``failed_attempt`` (1-based): min(max, initial * mult^(n-1)),
    then spread by up to ``jitter`` (a fraction) either way so that retries of many runs that failed
    together do not hit the target together again."""
    p = {**DEFAULT_POLICY, **policy}
    exponential = float(p["initialBackoffSec"]) * float(p["multiplier"]) ** (failed_attempt - 1)
    delay = min(float(p["maxBackoffSec"]), exponential)
    spread = delay * float(p["jitter"])
    if spread:
        delay += (rand or random).uniform(-spread, spread)
    return max(0.0, min(delay, float(p["maxBackoffSec"])))


def next_attempt_at(policy: Mapping[str, Any] | None, failed_attempt: int, now: datetime) -> datetime | None:
    """When to try again after ``failed_attempt`` failed, or None when attempts are exhausted."""
    p = {**DEFAULT_POLICY, **(policy or {})}
    if failed_attempt >= int(p["maxAttempts"]):
        return None
    return now + timedelta(seconds=backoff_sec(p, failed_attempt))
