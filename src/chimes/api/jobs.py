"""The job endpoints: create, read, list, change, pause/resume and delete (API.md "Jobs")."""

from __future__ import annotations

import base64
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Query, Request, Response

from chimes import previews, tracing, wire
from chimes.api import homes, standby
from chimes.api.actors import note_of
from chimes.api.auth import current_principal
from chimes.api.clock import clock_of
from chimes.api.errors import ApiError, not_found, refuse_unstorable
from chimes.api.next_runs import next_runs
from chimes.api.responses import JSONResponse
from chimes.api.views import job_view, pause_view
from chimes.ids import id_from, run_id_from
from chimes.jobs import AtScheduleSpec, JobPatch, JobSpec
from chimes.security.refusals import PriorityNotAllowed
from chimes.services.jobs import IdempotencyConflict, JobService, UnknownCalendar, UpgradeInProgress, VersionMismatch
from chimes.store.calendars import calendars_named
from chimes.store.jobs import JobFilter
from chimes.store.shards import partition_moved
from chimes.store.tokens import Principal

router = APIRouter(tags=["jobs"])
Caller = Annotated[Principal, Depends(current_principal)]
IfMatch = Annotated[str | None, Header(alias="If-Match", max_length=1000,
                                       description='ETag(s) of the job this change was made against, or "*"')]


def _store(request: Request) -> JobService:
    return standby.jobs(request)


@router.post("/jobs", status_code=201, response_class=JSONResponse)
async def create_job(
    spec: JobSpec, request: Request, caller: Caller,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> JSONResponse:
    if spec.priority == "high":
        _grants_high_priority(caller)
    try:
        with tracing.span("chimes.job.create", request.headers) as traced:
            for tries_left in (1, 0):
                new_id = homes.new_job_id_for(request, caller.owner, idempotency_key)
                store = _store(request) if new_id is None else await homes.jobs_of(request, new_id)
                try:
                    created = await store.create(caller.owner, spec, clock_of(request).now(), idempotency_key, new_id,
                                                 note_of(request, caller))
                    break
                except Exception as exc:
                    # The catalog's fence: a shard was given this partition after this process read the map.
                    if not partition_moved(exc):
                        raise
                    await request.app.state.shards.refresh()
                    if not tries_left:
                        raise  # a move under way: chimes.api.moved replays the request until it cuts over
            traced |= {"chimes.job_id": str(created.job_id), "chimes.owner": caller.owner}
    except UnknownCalendar as exc:
        raise unknown_calendar(exc) from None
    except UpgradeInProgress as exc:
        raise upgrade_in_progress(exc) from None
    except IdempotencyConflict:
        raise ApiError(409, "idempotency_conflict",
                       "this Idempotency-Key was already used for a different job definition",
                       "Idempotency-Key") from None
    status = 201 if created.created else 200
    next_run_at = created.next_run_at
    if next_run_at is not None and not isinstance(spec.schedule, AtScheduleSpec) and spec.schedule.exclude_calendars:
        calendars = await calendars_named(request.app.state.pool, caller.owner, spec.schedule.exclude_calendars)
        next_run_at = previews.next_run(spec.to_wire(), created.job_id, next_run_at, 0, calendars)
    return JSONResponse({"jobId": created.job_id, "nextRunAt": next_run_at}, status_code=status,
                        headers={"ETag": etag(created.version)})


@router.get("/jobs", response_class=JSONResponse)
async def list_jobs(
    request: Request, caller: Caller,
    cursor: Annotated[str | None, Query(max_length=100)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    tag: Annotated[str | None, Query(min_length=1, max_length=64, description="jobs with this tag")] = None,
    name_prefix: Annotated[str | None, Query(alias="namePrefix", min_length=1, max_length=200,
                                             description="jobs whose name starts with this (case-sensitive)")] = None,
    paused: Annotated[bool | None, Query(description="paused jobs (true) or active ones (false)")] = None,
    kind: Annotated[Literal["cron", "interval", "at"] | None,
                    Query(description="jobs on a cron schedule, on an interval, or one-off (at)")] = None,
) -> JSONResponse:
    """The caller's jobs in creation order; the filters given all hold for each, and the cursor of a
    filtered list pages through that same filtered list."""
    refuse_unstorable(tag=tag, namePrefix=name_prefix)
    where = JobFilter(tag=tag, name_prefix=name_prefix, paused=paused, kind=kind)
    jobs = await homes.list_jobs(request, caller.owner_filter, _decode_cursor(cursor), limit + 1, where)
    page = jobs[:limit]
    next_cursor = _encode_cursor(page[-1].job_id) if len(jobs) > limit else None
    runs = await next_runs(request.app.state.pool, page)
    return JSONResponse({"jobs": [job_view(j, runs) for j in page], "nextCursor": next_cursor})


@router.get("/jobs/{job_id}", response_class=JSONResponse)
async def get_job(
    job_id: str, request: Request, caller: Caller,
    preview: Annotated[int | None, Query(ge=1, le=previews.MAX_PREVIEW,
                                         description="add nextRuns: the job's next N fire times")] = None,
) -> JSONResponse:
    parsed = parse_id(job_id, "job")
    job = await (await homes.jobs_of(request, parsed)).get(parsed, caller.owner_filter)
    if job is None:
        if await (await homes.runs_of(request, parsed)).history_visible(parsed, caller.owner_filter):
            raise ApiError(404, "job_deleted", f"job {parsed} was deleted; its runs stay listable at "
                           f"GET /jobs/{parsed}/runs until retention removes them")
        raise not_found("job")
    view = job_view(job, await next_runs(request.app.state.pool, [job]))
    if preview is not None:
        definition = wire.definition(job.columns)
        names = definition["schedule"].get("excludeCalendars") or []
        calendars = await calendars_named(request.app.state.pool, job.owner, names) if names else []
        view["nextRuns"] = previews.upcoming(definition, job.job_id, job.next_run_at, preview, job.slots_fired,
                                             calendars)
    return JSONResponse(view, headers={"ETag": etag(job.version)})


@router.patch("/jobs/{job_id}", response_class=JSONResponse)
async def update_job(job_id: str, patch: JobPatch, request: Request, caller: Caller,
                     if_match: IfMatch = None) -> JSONResponse:
    parsed = parse_id(job_id, "job")
    if patch.priority == "high":
        _grants_high_priority(caller)
    try:
        job = await (await homes.jobs_of(request, parsed)).update(parsed, caller.owner_filter, patch,
                                                                  clock_of(request).now(), matching_versions(if_match),
                                                                  note_of(request, caller), actor=caller.actor)
    except VersionMismatch as exc:
        raise precondition_failed(exc.current) from None
    except UnknownCalendar as exc:
        raise unknown_calendar(exc) from None
    except UpgradeInProgress as exc:
        raise upgrade_in_progress(exc) from None
    if job is None:
        raise not_found("job")
    return JSONResponse(job_view(job, await next_runs(request.app.state.pool, [job])),
                        headers={"ETag": etag(job.version)})


@router.get("/jobs/{job_id}/pauses", response_class=JSONResponse)
async def job_pauses(job_id: str, request: Request, caller: Caller,
                     limit: Annotated[int, Query(ge=1, le=500)] = 50) -> JSONResponse:
    """The job's pauses, newest first: who paused it and why, and who resumed it."""
    parsed = parse_id(job_id, "job")
    found = await (await homes.jobs_of(request, parsed)).pauses(parsed, caller.owner_filter, limit)
    if found is None:
        raise not_found("job")
    return JSONResponse({"pauses": [pause_view(p) for p in found]})
def upgrade_in_progress(exc: UpgradeInProgress) -> ApiError:
    return ApiError(409, "upgrade_in_progress", f"schedule: {exc}", "schedule")


def unknown_calendar(exc: UnknownCalendar) -> ApiError:
    return ApiError(422, "invalid_request", f"schedule.excludeCalendars: {exc}", "schedule.excludeCalendars")


@router.delete("/jobs/{job_id}", status_code=204)
async def delete_job(job_id: str, request: Request, caller: Caller, if_match: IfMatch = None) -> Response:
    parsed = parse_id(job_id, "job")
    try:
        deleted = await (await homes.jobs_of(request, parsed)).delete(parsed, caller.owner_filter,
                                                                      matching_versions(if_match),
                                                                      note_of(request, caller))
    except VersionMismatch as exc:
        raise precondition_failed(exc.current) from None
    if not deleted:
        raise not_found("job")
    return Response(status_code=204)


def _grants_high_priority(caller: Principal) -> None:
    """Only an admin sets ``priority: high``: it goes before every other team's runs (refusals)."""
    if not caller.admin:
        raise PriorityNotAllowed(caller.owner)


def etag(version: int) -> str:
    """A job's entity tag: its version, which every change bumps (a strong tag: the version names
    exactly one definition of that job)."""
    return f'"{version}"'


def matching_versions(if_match: str | None) -> frozenset[int] | None:
    """The job versions an If-Match header accepts: None for any (no header, or ``*``). Tags are
    compared strongly (RFC 9110 13.1.1): a weak tag, or one this API never gave, matches nothing."""
    if if_match is None or if_match.strip() == "*":
        return None
    versions = set()
    for tag in if_match.split(","):
        text = tag.strip().removeprefix('"').removesuffix('"')
        if text.isdigit() and len(text) < 10:
            versions.add(int(text))
    return frozenset(versions)


def precondition_failed(current: int) -> ApiError:
    return ApiError(412, "precondition_failed",
                    f"If-Match: the job was changed since; it is now at version {current} (ETag {etag(current)}): "
                    "read it again and retry", "If-Match", headers={"ETag": etag(current)})


def parse_id(value: str, what: str) -> uuid.UUID:
    """An id from the path; a malformed one is simply not found, like an id of another team."""
    parsed = id_from(value)
    if parsed is None:
        raise not_found(what)
    return parsed


def parse_run_id(value: str) -> uuid.UUID:
    """A run id must carry a scheduled time (ids.py); any other UUID names no run."""
    run_id = run_id_from(value)
    if run_id is None:
        raise not_found("run")
    return run_id


def _encode_cursor(job_id: uuid.UUID) -> str:
    return base64.urlsafe_b64encode(job_id.bytes).decode().rstrip("=")


def _decode_cursor(cursor: str | None) -> uuid.UUID | None:
    if not cursor:
        return None
    try:
        return uuid.UUID(bytes=base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except ValueError:
        raise ApiError(400, "invalid_request", "cursor is not one this API returned", "cursor") from None


