"""``/calendars``: an owner's exclusion calendars (chimes.calendars), kept in the catalog and named by
jobs in ``schedule.excludeCalendars``. Each token's calendars are its owner's, as its jobs are."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request, Response

from chimes.api import homes
from chimes.api.actors import note_of
from chimes.api.auth import current_principal
from chimes.api.errors import ApiError, not_found
from chimes.api.responses import JSONResponse
from chimes.calendars import CALENDAR_NAME, CalendarSpec
from chimes.store import calendars as calendar_store
from chimes.store.audit import record
from chimes.store.calendars import CalendarRecord
from chimes.store.db import Pool, transaction
from chimes.store.tokens import Principal

router = APIRouter(tags=["calendars"])
Caller = Annotated[Principal, Depends(current_principal)]
Name = Annotated[str, Path(pattern=CALENDAR_NAME, description="the calendar's name, unique per owner")]
JOBS_NAMED = 20  # jobs named in a refused delete


def _catalog(request: Request) -> Pool:
    pool: Pool = request.app.state.pool
    return pool


def calendar_view(record: CalendarRecord) -> dict[str, Any]:
    return {"name": record.name, "owner": record.owner, **record.shown, "version": record.version,
            "updatedAt": record.updated_at}


@router.put("/calendars/{name}", response_class=JSONResponse)
async def put_calendar(name: Name, spec: CalendarSpec, request: Request, caller: Caller) -> JSONResponse:
    """Create or replace the calendar; scheduler nodes fire by the new one within seconds."""
    async with transaction(_catalog(request)) as conn:
        before = await calendar_store.get_calendar(conn, caller.owner, name)
        _, created = await calendar_store.put_calendar(conn, caller.owner, name, spec)
        await record(conn, note_of(request, caller), "calendar.put", f"calendar {name}",
                     None if before is None else before.shown, spec.to_wire(), subject_owner=caller.owner)
    saved = await calendar_store.get_calendar(_catalog(request), caller.owner, name)
    if saved is None:  # deleted in between
        raise not_found("calendar")
    return JSONResponse(calendar_view(saved), status_code=201 if created else 200)


@router.get("/calendars", response_class=JSONResponse)
async def list_calendars(request: Request, caller: Caller) -> JSONResponse:
    records = await calendar_store.list_calendars(_catalog(request), caller.owner_filter)
    return JSONResponse({"calendars": [calendar_view(r) for r in records]})


@router.get("/calendars/{name}", response_class=JSONResponse)
async def get_calendar(name: Name, request: Request, caller: Caller) -> JSONResponse:
    record = await calendar_store.get_calendar(_catalog(request), caller.owner, name)
    if record is None:
        raise not_found("calendar")
    return JSONResponse(calendar_view(record))


@router.delete("/calendars/{name}", status_code=204)
async def delete_calendar(name: Name, request: Request, caller: Caller) -> Response:
    """Refused (409, naming them) while jobs of the owner's refer to the calendar: their excluded
    days would silently start to run."""
    async with transaction(_catalog(request)) as conn:
        # Locked first: a job being written that names it waits for this delete, or this for it.
        if not await calendar_store.lock_calendar(conn, caller.owner, name):
            raise not_found("calendar")
        before = await calendar_store.get_calendar(conn, caller.owner, name)
        using = []
        for pool in await homes.pools_for(request, None):
            using += await calendar_store.jobs_using_calendar(pool, caller.owner, name, JOBS_NAMED)
        if using:
            raise ApiError(409, "calendar_in_use",
                           f"calendar {name!r} is named in schedule.excludeCalendars of jobs "
                           f"{', '.join(str(j) for j in using[:JOBS_NAMED])}: remove it from them first", "name")
        await calendar_store.delete_calendar(conn, caller.owner, name)
        await record(conn, note_of(request, caller), "calendar.delete", f"calendar {name}",
                     None if before is None else before.shown, None, subject_owner=caller.owner)
    return Response(status_code=204)
