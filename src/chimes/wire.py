"""A stored job's definition in its wire form (API.md: camelCase, JobSpec's aliases), built from the
store's record of it. The store knows rows; the API, the dashboard and the services read this."""

from __future__ import annotations

from typing import Any

from chimes.enums import Priority
from chimes.jobs import DEFAULT_NOTIFY_ON
from chimes.store.jobs import JobColumns


def definition(columns: JobColumns) -> dict[str, Any]:
    """The definition as the API shows it and JobSpec reads it (sealed secrets as stored)."""
    if columns.cron is not None:
        schedule: dict[str, Any] = {"cron": columns.cron, "timezone": columns.timezone}
        optional = {"jitterSec": columns.jitter_sec, "dstGap": columns.dst_gap, "dstFold": columns.dst_fold}
        schedule.update((key, value) for key, value in optional.items() if value)
    elif columns.every_sec is not None:
        schedule = {"everySec": columns.every_sec, "phaseSec": columns.phase_sec}
        if columns.jitter_sec:
            schedule["jitterSec"] = columns.jitter_sec
    else:
        schedule = {"at": columns.run_at}
    if columns.run_at is None:
        bounds = (("startAt", columns.start_at), ("endAt", columns.end_at), ("maxRuns", columns.max_runs),
                  ("excludeCalendars", columns.exclude_calendars))
        schedule.update((key, value) for key, value in bounds if value is not None)
    wire = {
        "name": columns.name,
        "schedule": schedule,
        "task": columns.task,
        "retryPolicy": columns.retry_policy,
        "timeoutSec": columns.timeout_sec,
        "concurrency": columns.concurrency,
        "queueLimit": columns.queue_limit,
        "priority": Priority(columns.priority).label,
        "catchUp": columns.catch_up,
        "tags": columns.tags,
        "startDeadlineSec": columns.start_deadline_sec,
    }
    if columns.notify_url:
        wire["notifyUrl"] = columns.notify_url
    if columns.pause_after_failures is not None:
        wire["pauseAfterFailures"] = columns.pause_after_failures
    if columns.delete_after_completion:
        wire["deleteAfterCompletion"] = True
    if tuple(columns.notify_on) != DEFAULT_NOTIFY_ON:
        wire["notifyOn"] = columns.notify_on
    return wire
