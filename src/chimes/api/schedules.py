"""``POST /schedules/preview``: the fire times of a schedule not saved yet, computed as the scheduler
would (chimes.previews), so that a schedule can be checked before a job is made of it."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from chimes import previews
from chimes.api.auth import reading_principal
from chimes.api.clock import clock_of
from chimes.api.errors import ApiError
from chimes.api.responses import JSONResponse
from chimes.calendars import NOT_FOUND
from chimes.ids import schedulable
from chimes.instants import Instant
from chimes.jobs import AtScheduleSpec, ScheduleSpec
from chimes.store.calendars import calendars_named
from chimes.store.tokens import Principal

router = APIRouter(tags=["schedules"])
DEFAULT_PREVIEW = 10


class SchedulePreviewRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schedule: ScheduleSpec
    n: Annotated[int, Field(ge=1, le=previews.MAX_PREVIEW)] = DEFAULT_PREVIEW
    after: Instant | None = Field(default=None, description="fires after this time (default: now)")

    @field_validator("after")
    @classmethod
    def _schedulable(cls, value: datetime | None) -> datetime | None:
        return None if value is None else schedulable(value)  # no slot can be walked to from beyond


@router.post("/schedules/preview", response_class=JSONResponse)
async def preview_schedule(body: SchedulePreviewRequest, request: Request,
                           caller: Annotated[Principal, Depends(reading_principal)]) -> JSONResponse:
    """Computes and changes nothing: a read-only token may ask."""
    after: datetime = body.after or clock_of(request).now()
    names = [] if isinstance(body.schedule, AtScheduleSpec) else body.schedule.exclude_calendars or []
    calendars = await calendars_named(request.app.state.pool, caller.owner, names) if names else []
    unknown = [c.name for c in calendars if c.problem == NOT_FOUND]
    if unknown:
        raise ApiError(422, "invalid_request", f"schedule.excludeCalendars: unknown calendar "
                       f"{', '.join(repr(n) for n in unknown)}", "schedule.excludeCalendars")
    unreadable = next((c for c in calendars if c.problem is not None), None)
    if unreadable is not None:  # it would skip every slot: say why rather than preview none
        raise ApiError(422, "invalid_request", f"schedule.excludeCalendars: calendar {unreadable.name!r} "
                       f"{unreadable.problem}: put it again (PUT /calendars/{unreadable.name})",
                       "schedule.excludeCalendars")
    fires = previews.fires_after(body.schedule, None, after, body.n, calendars)
    answer: dict[str, Any] = {"fires": fires}
    if not isinstance(body.schedule, AtScheduleSpec) and body.schedule.jitter_sec:
        # A job's jitter depends on its id: a saved job's preview (GET /jobs/{id}?preview=N) includes it.
        answer["jitterSec"] = body.schedule.jitter_sec
    return JSONResponse(answer)
