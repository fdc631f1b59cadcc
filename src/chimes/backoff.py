"""Retry timing: exponential backoff with jitter, from a job's retry policy."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class Retry:
    """What follows a failed attempt: the next one at ``at``, or none (``at`` None)."""

    at: datetime | None
    # Set when it is the policy's maxDurationSec, not its maxAttempts, that ends the run: why, for the
    # run's error.
    past_deadline: str | None = None


def plan_retry(policy: Mapping[str, Any] | None, failed_attempt: int, now: datetime,
               since: datetime | None = None, *, delay_sec: float | None = None) -> Retry:
    """The attempt after ``failed_attempt`` (1-based), which failed at ``now``: after the backoff
    (or ``delay_sec``), unless attempts are exhausted or it would start past ``maxDurationSec``
    counted from ``since`` (the run's scheduled time). The one place where workers, the reaper and
    the callback endpoint decide a retry."""
    p = {**DEFAULT_POLICY, **(policy or {})}
    if failed_attempt >= int(p["maxAttempts"]):
        return Retry(None)
    at = now + timedelta(seconds=backoff_sec(p, failed_attempt) if delay_sec is None else delay_sec)
    limit = p.get("maxDurationSec")
    if limit is not None and since is not None and at > since + timedelta(seconds=float(limit)):
        return Retry(None, f"no attempt after {failed_attempt}: the next would start past retryPolicy.maxDurationSec "
                           f"({float(limit):g} s from the scheduled time)")
    return Retry(at)


def next_attempt_at(policy: Mapping[str, Any] | None, failed_attempt: int, now: datetime,
                    since: datetime | None = None) -> datetime | None:
    """When to try again after ``failed_attempt`` failed, or None when attempts are exhausted or the
    next would start past ``maxDurationSec`` from ``since`` (see :func:`plan_retry`)."""
    return plan_retry(policy, failed_attempt, now, since).at
