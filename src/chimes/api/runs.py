"""The run endpoints: history per job, one run with its attempts, run now, re-run, cancel."""

from __future__ import annotations

import base64
import uuid
from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request

from chimes.api.auth import current_principal
from chimes.api.errors import ApiError, not_found
from chimes.api.jobs import parse_id
from chimes.api.responses import JSONResponse
from chimes.api.views import run_view
from chimes.ids import scheduled_at_of
from chimes.store.runs import RunStore
from chimes.store.tokens import Principal

router = APIRouter(tags=["runs"])
Caller = Annotated[Principal, Depends(current_principal)]
RunStatus = Literal["scheduled", "running", "succeeded", "failed", "skipped", "cancelled"]


def _store(request: Request) -> RunStore:
    return request.app.state.runs


@router.get("/jobs/{job_id}/runs", response_class=JSONResponse)
async def list_runs(
    job_id: str, request: Request, caller: Caller,
    status: RunStatus | None = None,
    cursor: Annotated[str | None, Query(max_length=100)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> JSONResponse:
    job = parse_id(job_id, "job")
    store = _store(request)
    if not await store.job_visible(job, caller.owner_filter):
        raise not_found("job")
    rows = await store.list(job, caller.owner_filter, status, _decode_cursor(cursor), limit + 1)
    page = rows[:limit]
    next_cursor = base64.urlsafe_b64encode(page[-1]["run_id"].bytes).decode().rstrip("=") if len(rows) > limit else None
    return JSONResponse({"runs": [run_view(r) for r in page], "nextCursor": next_cursor})


@router.post("/jobs/{job_id}/runs", status_code=202, response_class=JSONResponse)
async def run_now(job_id: str, request: Request, caller: Caller) -> JSONResponse:
    run_id = await _store(request).start_now(parse_id(job_id, "job"), caller.owner_filter, "manual", datetime.now(UTC))
    if run_id is None:
        raise not_found("job")
    return JSONResponse({"runId": run_id}, status_code=202)


@router.get("/runs/{run_id}", response_class=JSONResponse)
async def get_run(run_id: str, request: Request, caller: Caller) -> JSONResponse:
    found = await _store(request).get(parse_id(run_id, "run"), caller.owner_filter)
    if found is None:
        raise not_found("run")
    run, attempts = found
    return JSONResponse(run_view(run, attempts))


@router.post("/runs/{run_id}/rerun", status_code=202, response_class=JSONResponse)
async def rerun(run_id: str, request: Request, caller: Caller) -> JSONResponse:
    store = _store(request)
    found = await store.get(parse_id(run_id, "run"), caller.owner_filter)
    if found is None:
        raise not_found("run")
    new_run = await store.start_now(found[0]["job_id"], caller.owner_filter, "rerun", datetime.now(UTC))
    if new_run is None:
        raise ApiError(409, "job_deleted", "the job of this run was deleted, so it cannot run again")
    return JSONResponse({"runId": new_run}, status_code=202)


@router.post("/runs/{run_id}/cancel", response_class=JSONResponse)
async def cancel(run_id: str, request: Request, caller: Caller) -> JSONResponse:
    store = _store(request)
    parsed = parse_id(run_id, "run")
    if not await store.cancel(parsed, caller.owner_filter, f"cancelled by {caller.owner}"):
        found = await store.get(parsed, caller.owner_filter)
        if found is None:
            raise not_found("run")
        raise ApiError(409, "run_finished", f"the run already ended as {found[0]['status']}")
    found = await store.get(parsed, caller.owner_filter)
    assert found is not None
    return JSONResponse(run_view(*found))


def _decode_cursor(cursor: str | None) -> tuple[datetime, uuid.UUID] | None:
    if not cursor:
        return None
    try:
        run_id = uuid.UUID(bytes=base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except ValueError:
        raise ApiError(400, "invalid_request", "cursor is not one this API returned", "cursor") from None
    return scheduled_at_of(run_id), run_id
