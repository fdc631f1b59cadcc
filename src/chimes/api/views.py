"""How jobs and runs look on the wire (API.md)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from chimes import wire
from chimes.security.secrets import redact
from chimes.store.jobs import JobRecord, LastRun, PauseRecord


def job_view(job: JobRecord, next_runs: Mapping[uuid.UUID, datetime | None] | None = None) -> dict[str, Any]:
    """``next_runs``: the jobs' next runs past the slots their calendars exclude (chimes.api.next_runs);
    without, the pending trigger's time."""
    definition = wire.definition(job.columns)
    return {
        "jobId": job.job_id,
        "owner": job.owner,
        **redact(definition),  # secret values never leave the database
        "paused": job.paused,
        "pausedAt": job.paused_at,
        "pausedBy": job.paused_by,
        "pauseNote": job.pause_note,
        "version": job.version,
        "nextRunAt": job.next_run_at if next_runs is None else next_runs.get(job.job_id, job.next_run_at),
        "createdAt": job.created_at,
        "updatedAt": job.updated_at,
        "lastRun": last_run_view(job.last_run),
        # Past its endAt or its maxRuns: nothing is left to fire (docs/semantics.md, "Bounds").
        "scheduleEnded": schedule_ended(job, definition),
    } | ({} if job.remaining_runs is None else {"remainingRuns": job.remaining_runs})


def schedule_ended(job: JobRecord, definition: dict[str, Any]) -> bool:
    """``definition``: the job's, in its wire form."""
    schedule = definition["schedule"]
    if "at" in schedule or job.paused:
        return False
    return job.remaining_runs == 0 or ("endAt" in schedule and job.next_run_at is None)


def last_run_view(run: LastRun | None) -> dict[str, Any] | None:
    if run is None:
        return None
    return {"runId": run.run_id, "status": run.status, "scheduledAt": run.scheduled_at,
            "finishedAt": run.finished_at, "error": run.error}


def pause_view(pause: PauseRecord) -> dict[str, Any]:
    return {"pausedAt": pause.paused_at, "pausedBy": pause.paused_by, "note": pause.note,
            "resumedAt": pause.resumed_at, "resumedBy": pause.resumed_by}


def run_view(run: Any, attempts: list[Any] | None = None) -> dict[str, Any]:
    view = {
        "runId": run["run_id"],
        "jobId": run["job_id"],
        "scheduledAt": run["scheduled_at"],
        "firedAt": run["fired_at"],
        "status": run["status"],
        "attempt": run["attempt"],
        "trigger": run["trigger"],
        "startedAt": run["started_at"],
        "finishedAt": run["finished_at"],
        "error": run["error"],
        "reason": run["reason"],
    }
    if attempts is not None:
        view["attempts"] = [_attempt_view(a) for a in attempts]
        if run["status"] == "running":  # the attempt under way has no row until it ends
            view["attempts"].append({
                "attempt": run["attempt"], "workerId": run["worker_id"], "startedAt": run["started_at"],
                "finishedAt": None, "status": "running", "error": None, "output": None,
            })
    return view


def _attempt_view(attempt: Any) -> dict[str, Any]:
    return {
        "attempt": attempt["attempt"], "workerId": attempt["worker_id"], "startedAt": attempt["started_at"],
        "finishedAt": attempt["finished_at"], "status": attempt["status"], "error": attempt["error"],
        "output": attempt["output"],
    }
