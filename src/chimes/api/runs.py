"""The run endpoints: history per job, one run with its attempts, run now, re-run, cancel."""

from __future__ import annotations

import base64
import uuid
from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator

from chimes.api import homes
from chimes.api.actors import note_of
from chimes.api.auth import current_principal
from chimes.api.clock import clock_of
from chimes.api.errors import ApiError, not_found
from chimes.api.jobs import parse_id, parse_run_id
from chimes.api.responses import JSONResponse
from chimes.api.views import run_view
from chimes.enums import Priority, RunTrigger
from chimes.ids import schedulable, scheduled_at_of_or_none
from chimes.jobs import storable
from chimes.receiver.callbacks import MAX_ERROR_CHARS, MAX_OUTPUT_CHARS
from chimes.store.calendars import calendars_named
from chimes.store.runs import BackfillError
from chimes.store.tokens import Principal

router = APIRouter(tags=["runs"])
Caller = Annotated[Principal, Depends(current_principal)]
BACKFILL_LIMIT = 1000
CALLBACK_LEASE_SEC = 30.0  # each heartbeat from a target extends the run's lease this far
RunStatus = Literal["scheduled", "running", "succeeded", "failed", "skipped", "cancelled"]


@router.get("/jobs/{job_id}/runs", response_class=JSONResponse)
async def list_runs(
    job_id: str, request: Request, caller: Caller,
    status: RunStatus | None = None,
    cursor: Annotated[str | None, Query(max_length=100)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> JSONResponse:
    """A job's runs; after the job is deleted, its history stays listable (``jobDeleted: true``) until
    retention removes it."""
    job = parse_id(job_id, "job")
    store = await homes.runs_of(request, job)
    deleted = not await store.job_visible(job, caller.owner_filter)
    if deleted and not await store.history_visible(job, caller.owner_filter):
        raise not_found("job")
    rows = await store.list(job, caller.owner_filter, status, _decode_cursor(cursor), limit + 1)
    page = rows[:limit]
    next_cursor = base64.urlsafe_b64encode(page[-1]["run_id"].bytes).decode().rstrip("=") if len(rows) > limit else None
    return JSONResponse({"runs": [run_view(r) for r in page], "nextCursor": next_cursor, "jobDeleted": deleted})


@router.post("/jobs/{job_id}/runs", status_code=202, response_class=JSONResponse)
async def run_now(job_id: str, request: Request, caller: Caller) -> JSONResponse:
    job = parse_id(job_id, "job")
    run_id = await (await homes.runs_of(request, job)).start_now(job, caller.owner_filter, RunTrigger.MANUAL,
                                                                 clock_of(request).now(), note_of(request, caller))
    if run_id is None:
        raise not_found("job")
    return JSONResponse({"runId": run_id}, status_code=202)


class BackfillRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    start: AwareDatetime
    end: AwareDatetime

    @field_validator("start", "end")
    @classmethod
    def _schedulable(cls, value: datetime) -> datetime:
        return schedulable(value)


@router.post("/jobs/{job_id}/backfill", status_code=202, response_class=JSONResponse)
async def backfill(job_id: str, body: BackfillRequest, request: Request, caller: Caller) -> JSONResponse:
    """Create the runs the schedule would have made in (start, end], as catch-up runs, at most
    BACKFILL_LIMIT of them; slots that already have a run keep it (run ids are per slot), and slots the
    job's calendars exclude are recorded as skipped, as the scheduler records them."""
    if body.end <= body.start:
        raise ApiError(422, "invalid_request", "end: must be after start", "end")
    if body.end > clock_of(request).now():
        raise ApiError(422, "invalid_request", "end: backfill covers the past; the schedule covers the future",
                       "end")
    try:
        job = parse_id(job_id, "job")
        result = await (await homes.runs_of(request, job)).backfill(
            job, caller.owner_filter, body.start, body.end, BACKFILL_LIMIT, note_of(request, caller),
            lambda owner, names: calendars_named(request.app.state.pool, owner, names))
    except BackfillError as exc:
        raise ApiError(422, "invalid_request", f"{exc.field}: {exc}", exc.field) from None
    if result is None:
        raise not_found("job")
    return JSONResponse({"runIds": result.created, "created": len(result.created), "existing": result.existing,
                         "skipped": result.skipped}, status_code=202)


class HeartbeatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lease_token: uuid.UUID = Field(alias="leaseToken")


class CompleteRequest(HeartbeatRequest):
    status: Literal["succeeded", "failed"]
    error: Annotated[str | None, Field(max_length=MAX_ERROR_CHARS)] = None
    output: Annotated[str | None, Field(max_length=MAX_OUTPUT_CHARS)] = None

    # A client's report is refused, naming the field, rather than stored altered (PostgreSQL text
    # cannot hold a NUL); the receiver makes a task's own output storable before it reports it.
    _text = storable("error", "output")


STALE_LEASE = "the lease token is not current: the run ended, was cancelled, or was given to another attempt"


@router.post("/runs/{run_id}/heartbeat", response_class=JSONResponse)
async def heartbeat(run_id: str, body: HeartbeatRequest, request: Request, caller: Caller) -> JSONResponse:
    """For a target that answered 202 to a `callback` task: keeps the run's lease alive."""
    parsed = parse_run_id(run_id)
    expires = await (await homes.runs_of_run(request, parsed)).callback_heartbeat(
        parsed, caller.owner_filter, body.lease_token, CALLBACK_LEASE_SEC)
    if expires is None:
        raise ApiError(409, "stale_lease", STALE_LEASE, "leaseToken")
    return JSONResponse({"leaseExpiresAt": expires})


@router.post("/runs/{run_id}/complete", response_class=JSONResponse)
async def complete(run_id: str, body: CompleteRequest, request: Request, caller: Caller) -> JSONResponse:
    """For a target that answered 202 to a `callback` task: reports how the attempt ended."""
    parsed = parse_run_id(run_id)
    store = await homes.runs_of_run(request, parsed)
    accepted = await store.callback_complete(parsed, caller.owner_filter, body.lease_token, body.status, body.error,
                                             body.output, clock_of(request).now())
    if not accepted:
        raise ApiError(409, "stale_lease", STALE_LEASE, "leaseToken")
    found = await store.get(parsed, caller.owner_filter)
    assert found is not None
    return JSONResponse(run_view(found.run, found.attempts))


@router.get("/queue", response_class=JSONResponse)
async def queue(request: Request, caller: Caller) -> JSONResponse:
    """Depth and lag of each priority tier of the run queue (fleet-wide, so for admins)."""
    if not caller.admin:
        raise ApiError(403, "forbidden", "the queue is fleet-wide: this needs an admin token")
    now = clock_of(request).now()
    depth: dict[int, int] = {}
    oldest_of: dict[int, datetime] = {}
    for store in await homes.every_run_store(request):  # with shards, each shard's queue, added up
        for r in await store.queue_depth():
            depth[r["tier"]] = depth.get(r["tier"], 0) + r["depth"]
            if r["oldest_enqueued_at"] is not None:
                oldest_of[r["tier"]] = min(r["oldest_enqueued_at"], oldest_of.get(r["tier"], r["oldest_enqueued_at"]))
    tiers = []
    for tier in Priority:
        oldest = oldest_of.get(tier)
        tiers.append({"tier": tier.label, "depth": depth.get(tier, 0), "oldestEnqueuedAt": oldest,
                      "lagSec": round((now - oldest).total_seconds(), 3) if oldest else 0.0})
    return JSONResponse({"tiers": tiers})


@router.get("/runs/{run_id}", response_class=JSONResponse)
async def get_run(run_id: str, request: Request, caller: Caller) -> JSONResponse:
    parsed = parse_run_id(run_id)
    found = await (await homes.runs_of_run(request, parsed)).get(parsed, caller.owner_filter)
    if found is None:
        raise not_found("run")
    return JSONResponse(run_view(found.run, found.attempts))


@router.post("/runs/{run_id}/rerun", status_code=202, response_class=JSONResponse)
async def rerun(run_id: str, request: Request, caller: Caller) -> JSONResponse:
    parsed = parse_run_id(run_id)
    store = await homes.runs_of_run(request, parsed)
    found = await store.get(parsed, caller.owner_filter)
    if found is None:
        raise not_found("run")
    new_run = await store.start_now(found.job_id, caller.owner_filter, RunTrigger.RERUN, clock_of(request).now(),
                                    note_of(request, caller))
    if new_run is None:
        raise ApiError(409, "job_deleted", "the job of this run was deleted, so it cannot run again")
    return JSONResponse({"runId": new_run}, status_code=202)


@router.post("/runs/{run_id}/cancel", response_class=JSONResponse)
async def cancel(run_id: str, request: Request, caller: Caller) -> JSONResponse:
    parsed = parse_run_id(run_id)
    store = await homes.runs_of_run(request, parsed)
    if not await store.cancel(parsed, caller.owner_filter, f"cancelled by {caller.owner}", note_of(request, caller)):
        found = await store.get(parsed, caller.owner_filter)
        if found is None:
            raise not_found("run")
        raise ApiError(409, "run_finished", f"the run already ended as {found.status}")
    found = await store.get(parsed, caller.owner_filter)
    assert found is not None
    return JSONResponse(run_view(found.run, found.attempts))


def _decode_cursor(cursor: str | None) -> tuple[datetime, uuid.UUID] | None:
    if not cursor:
        return None
    try:
        run_id = uuid.UUID(bytes=base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except ValueError:
        raise ApiError(400, "invalid_request", "cursor is not one this API returned", "cursor") from None
    scheduled_at = scheduled_at_of_or_none(run_id)  # a forged cursor can encode a time past year 9999
    if scheduled_at is None:
        raise ApiError(400, "invalid_request", "cursor is not one this API returned", "cursor")
    return scheduled_at, run_id
