"""The dashboard's pages: jobs, one job, one run, the fleet. GET only; forms post to actions.py.

Pages that change while you look at them (the job list, a job's runs, an unfinished run, the fleet)
refresh themselves with htmx: the page asks for ``?fragment=...`` and swaps in just that part.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse

from chimes import previews, wire
from chimes.api import homes, standby
from chimes.api.clock import clock_of
from chimes.api.next_runs import next_runs
from chimes.dashboard import fleet as fleet_view
from chimes.dashboard import views
from chimes.dashboard.render import not_found, page
from chimes.dashboard.session import viewer
from chimes.ids import id_from, run_id_from, scheduled_at_of
from chimes.store import audit
from chimes.store.calendars import calendars_named
from chimes.store.dashboard import (
    JOB_FILTERS,
    LAG_BOUNDS,
    DashboardStore,
    Fleet,
    JobCursor,
    RunCursor,
    merge_job_pages,
)
from chimes.store.db import Pool
from chimes.store.tokens import Principal

router = APIRouter(include_in_schema=False)
Viewer = Annotated[Principal, Depends(viewer)]
PAGE_SIZE = 50
RUN_STATUSES = ("failed", "succeeded", "running", "scheduled", "cancelled", "skipped")
LAG_WINDOW = timedelta(minutes=10)
FAILURE_MINUTES = 30
DEAD_SHOWN = 20  # dead-lettered notifications listed on a job's page (GET /notifications has them all)
AUDIT_SHOWN = 20  # audit entries on a job's page, newest first (GET /audit?jobId= has them all)
NOTICES = {
    "paused": "Paused: no new runs will start until you resume it.",
    "resumed": "Resumed: the schedule is active again.",
    "started": "Run started: it is queued for a worker now.",
    "cancelled": "Cancelled.",
    "already-finished": "That run had already finished, so there was nothing to cancel.",
}


@router.get("/jobs", response_class=HTMLResponse)
async def jobs_page(
    request: Request, who: Viewer,
    q: Annotated[str, Query(max_length=200)] = "",
    show: str = "all", after: str | None = None, fragment: str | None = None,
) -> HTMLResponse:
    if "\x00" in q:  # PostgreSQL text cannot hold it
        return _bad_request(request, who, "The search text holds a NUL character; no job name can.")
    show = show if show in JOB_FILTERS else "all"
    if homes.sharded(request) is None:
        found = await DashboardStore(standby.pool(request)).jobs(who.owner_filter, q.strip(), show,
                                                                  _job_cursor(after), PAGE_SIZE)
    else:  # each home's first page after the cursor, merged (docs/scaling.md, "Shards")
        pages = await asyncio.gather(*(DashboardStore(pool).jobs(who.owner_filter, q.strip(), show,
                                                                 _job_cursor(after), PAGE_SIZE)
                                       for pool in await homes.pools_for(request, None)))
        found = merge_job_pages(list(pages), PAGE_SIZE)
    next_after = _encode_job_cursor(found.next) if found.next else None
    context: dict[str, Any] = {"viewer": who, "nav": "jobs", "jobs": found.jobs, "q": q.strip(), "show": show,
                               "next_runs": await next_runs(request.app.state.pool, found.jobs),
                               "after": after, "next_after": next_after, "filters": JOB_FILTERS}
    return page(request, "_jobs_table.html" if fragment == "table" else "jobs.html", **context)


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
async def job_page(
    job_id: str, request: Request, who: Viewer,
    status: str | None = None, before: str | None = None, started: str | None = None,
    notice: str | None = None, fragment: str | None = None,
) -> HTMLResponse:
    parsed = id_from(job_id)
    job = await (await homes.jobs_of(request, parsed)).get(parsed, who.owner_filter) if parsed else None
    if job is None:
        return not_found(request, who, "job")
    store = DashboardStore((await homes.pools_for(request, job.job_id))[0])  # with shards, the job's
    status = status if status in RUN_STATUSES else None
    started_id = run_id_from(started) if started else None
    started = str(started_id) if started_id else None
    try:
        cursor = _run_cursor(before)
    except ValueError:
        return _bad_request(request, who, "The before= value of this page is not a link the dashboard made. "
                                          "Start again from the job's page.")
    rows = await store.job_runs(job.job_id, status, cursor, PAGE_SIZE + 1)
    runs = rows[:PAGE_SIZE]
    next_before = _encode_run_cursor(runs[-1]["run_id"]) if len(rows) > PAGE_SIZE else None
    stall, dead_notifications = await store.job_alerts(job.job_id, DEAD_SHOWN)
    async with (await homes.pools_for(request, job.job_id))[0].acquire() as conn:
        changes = await audit.list_entries(conn, audit.AuditFilter(subject_owner=who.owner_filter, job_id=job.job_id),
                                           None, AUDIT_SHOWN)
    definition = wire.definition(job.columns)
    names = definition["schedule"].get("excludeCalendars") or []
    calendars = await calendars_named(request.app.state.pool, job.owner, names) if names else []
    context = {
        "audit": changes,
        "stall": stall, "dead_notifications": dead_notifications,
        "viewer": who, "nav": "jobs", "job": job, "runs": runs, "status_filter": status, "statuses": RUN_STATUSES,
        "before": before, "next_before": next_before, "started": started, "notice": NOTICES.get(notice or ""),
        "next_fires": views.next_fires(definition, job.next_run_at, job.job_id,
                                       slots_fired=job.slots_fired, calendars=calendars),
        "next_run": previews.next_run(definition, job.job_id, job.next_run_at, job.slots_fired, calendars),
        "remaining_runs": job.remaining_runs,
        "chart": _chart(runs), "task": definition["task"],
        "headers": views.masked(definition["task"].get("headers")),
        "env": views.masked(definition["task"].get("env")),
    }
    return page(request, "_runs.html" if fragment == "runs" else "job.html", **context)


@router.get("/runs/{run_id}", response_class=HTMLResponse)
async def run_page(run_id: str, request: Request, who: Viewer, notice: str | None = None,
                   fragment: str | None = None) -> HTMLResponse:
    parsed = run_id_from(run_id)
    found = await (await homes.runs_of_run(request, parsed)).get(parsed, who.owner_filter) if parsed else None
    if found is None:
        return not_found(request, who, "run")
    # Rows as read: the templates look their columns up by name.
    run: Any = found.run
    attempt_rows: list[Any] = list(found.attempts)
    attempts: list[dict[str, Any]] = [dict(a) for a in attempt_rows]
    if run["status"] == "running":  # the attempt under way has no row until it ends
        attempts.append({"attempt": run["attempt"], "worker_id": run["worker_id"], "started_at": run["started_at"],
                         "finished_at": None, "status": "running", "error": None, "output": None})
    job = await (await homes.jobs_of(request, run["job_id"])).get(run["job_id"], who.owner_filter)
    spans, events = views.timeline(run, attempts, clock_of(request).now())
    context: dict[str, Any] = {
        "viewer": who, "nav": "jobs", "run": run, "attempts": attempts, "job": job, "spans": spans, "events": events,
        "max_attempts": (job.columns.retry_policy or {}).get("maxAttempts") if job else None,
        "final": run["status"] in views.FINAL_STATUSES, "notice": NOTICES.get(notice or ""),
    }
    return page(request, "_run_body.html" if fragment == "body" else "run.html", **context)


@router.get("/fleet", response_class=HTMLResponse)
async def fleet_page(request: Request, who: Viewer, fragment: str | None = None) -> HTMLResponse:
    now = clock_of(request).now()

    async def fleet_of(pool: Pool) -> Fleet:
        # The queue is fleet-wide, so for admins only (as GET /queue); the template hides hosts and pids too.
        return await DashboardStore(pool).fleet(who.owner_filter, now, LAG_WINDOW, FAILURE_MINUTES,
                                                with_queue=who.admin)

    shards = homes.sharded(request)
    summaries: list[fleet_view.HomeSummary] = []
    if shards is None:
        fleet = await fleet_of(standby.pool(request))
    else:  # each home read on its own and added up; one that does not answer is named, not fatal
        owns = shards.map.homes()
        read = await asyncio.gather(*(fleet_of(pool) for pool in await shards.homes()), return_exceptions=True)
        summaries = [fleet_view.summarize(name, sorted(own), found, who.admin)
                     for (name, own), found in zip(owns, read, strict=True)]
        answered = [(found, own) for (_, own), found in zip(owns, read, strict=True) if isinstance(found, Fleet)]
        fleet = fleet_view.add_up([f for f, _ in answered], [sorted(own) for _, own in answered])
    context = {
        "viewer": who, "nav": "fleet", "fleet": fleet,
        "moves": await fleet_view.moves_shown(standby.pool(request)),  # in the catalog, with shards or without
        "lag_window_min": int(LAG_WINDOW.total_seconds() // 60),
        "lag_bars": views.lag_bars(LAG_BOUNDS, fleet.fire_lag.buckets),
        "failure_bars": views.minute_bars(fleet.failures, now, FAILURE_MINUTES),
        "failure_minutes": FAILURE_MINUTES, "failures_total": sum(r["failed"] for r in fleet.failures),
        "held": sum(len(n["partitions"]) for n in fleet.nodes),
        "in_flight": sum(w["in_flight"] for w in fleet.workers),
        "capacity": sum(w["concurrency"] for w in fleet.workers),
        "queued": sum(t.depth for t in fleet.queue),
        "shards": summaries,
    }
    return page(request, "_fleet_body.html" if fragment == "body" else "fleet.html", **context)


def _chart(runs: list[Any]) -> dict[str, list[Any]]:
    """Start lag and duration per run, oldest first, for the uPlot chart (seconds; null = no value)."""
    points = sorted(runs, key=lambda r: r["scheduled_at"])
    return {
        "x": [r["scheduled_at"].timestamp() for r in points],
        "lag": [views.between(r["scheduled_at"], r["first_started_at"]) for r in points],
        "duration": [views.between(r["started_at"], r["finished_at"]) for r in points],
    }


def _bad_request(request: Request, who: Principal, detail: str) -> HTMLResponse:
    return page(request, "not_found.html", status_code=400, viewer=who, what="request", detail=detail)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _encode_job_cursor(cursor: JobCursor) -> str:
    return _b64(cursor.job_id.bytes + cursor.name.encode())


def _job_cursor(text: str | None) -> JobCursor | None:
    """A cursor we did not make (edited by hand, truncated) just starts from the first page."""
    if not text or len(text) > 1200:
        return None
    try:
        raw = _unb64(text)
        cursor = JobCursor(raw[16:].decode(), uuid.UUID(bytes=raw[:16]))
    except ValueError:
        return None
    return None if "\x00" in cursor.name else cursor  # no name holds one; PostgreSQL refuses it


def _encode_run_cursor(run_id: uuid.UUID) -> str:
    return _b64(run_id.bytes)


def _run_cursor(text: str | None) -> RunCursor | None:
    """None for the first page; ValueError for a cursor that is not a run id of ours (edited, forged)."""
    if not text:
        return None
    if len(text) > 100:
        raise ValueError("cursor too long")
    run_id = run_id_from(str(uuid.UUID(bytes=_unb64(text))))  # binascii.Error is a ValueError
    if run_id is None:
        raise ValueError("not a run id")
    return RunCursor(scheduled_at_of(run_id), run_id)
