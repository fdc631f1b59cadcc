"""The OpenAPI document served at ``/openapi.json``: FastAPI's, completed so that it matches what
the handlers really answer: the success body of each endpoint, every error status with the one
error schema (``{"error", "message", "field", "details"}``), and bearer authentication.

The handlers build their answers as dicts (views.py); the models here describe those answers and
are checked against the running API by the schemathesis fuzz test (tests/integration/test_fuzz.py).
Objects allow more properties than they list, so that adding a field to an answer is never a break.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

#: Served without a token: liveness, this document, and fleet-wide metrics (no job, run or owner in them).
PUBLIC_PATHS = frozenset({"/healthz", "/openapi.json", "/metrics"})
PROMETHEUS_TEXT = "text/plain"
RunStatus = Literal["scheduled", "running", "succeeded", "failed", "skipped", "cancelled"]


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Answer):
    field: str
    message: str


class Error(_Answer):
    """Every error the API answers."""

    error: str = Field(description="a stable code: invalid_request, unauthorized, forbidden, not_found, ...")
    message: str = Field(description="what is wrong, for a person; starts with the field when there is one")
    field: str | None = Field(description="the offending request field as a dotted path, if any")
    details: list[ErrorDetail] | None = None


class JobCreated(_Answer):
    jobId: str
    nextRunAt: datetime | None


class LastRun(_Answer):
    runId: str
    status: RunStatus
    scheduledAt: datetime


class Job(_Answer):
    """A job as created (secret values read as ``********``), plus what Chimes knows about it."""

    jobId: str
    owner: str
    name: str
    schedule: dict[str, Any]
    task: dict[str, Any]
    paused: bool
    pausedAt: datetime | None = Field(None, description="while paused: since when")
    pausedBy: str | None = Field(None, description="while paused: who paused it (a token's name or owner, or "
                                                   "chimes for pauseAfterFailures)")
    pauseNote: str | None = Field(None, description="while paused: why, as given with the pause")
    version: int
    nextRunAt: datetime | None
    createdAt: datetime
    updatedAt: datetime
    lastRun: LastRun | None
    scheduleEnded: bool = Field(False, description="the schedule is past its endAt: nothing is left to fire")
    remainingRuns: int | None = Field(None, description="the slots left to a job with schedule.maxRuns")
    nextRuns: list[datetime] | None = Field(
        None, description="with ?preview=N: the next N fire times, as the scheduler fires them (DST policy, "
                          "jitter, interval phase, startAt/endAt)")


class SchedulePreview(_Answer):
    """The next fire times of a schedule not saved yet."""

    fires: list[datetime]
    jitterSec: int | None = Field(None, description="each fire of a job with this schedule comes a fixed delay "
                                                    "in [0, jitterSec) later, set by the job's id")


class Calendar(_Answer):
    """An exclusion calendar: whole days in its time zone and time windows that jobs naming it skip."""

    name: str
    owner: str
    timezone: str
    dates: list[str]
    windows: list[dict[str, Any]]
    version: int
    updatedAt: datetime


class CalendarList(_Answer):
    calendars: list[Calendar]


class Pause(_Answer):
    pausedAt: datetime
    pausedBy: str
    note: str | None
    resumedAt: datetime | None
    resumedBy: str | None


class PauseList(_Answer):
    """A job's pauses, newest first."""

    pauses: list[Pause]


class JobList(_Answer):
    jobs: list[Job]
    nextCursor: str | None


class Attempt(_Answer):
    attempt: int
    status: str
    startedAt: datetime | None
    finishedAt: datetime | None
    error: str | None


class Run(_Answer):
    runId: str
    jobId: str
    scheduledAt: datetime
    status: RunStatus
    attempt: int
    trigger: str
    startedAt: datetime | None
    finishedAt: datetime | None
    error: str | None
    attempts: list[Attempt] | None = None


class RunList(_Answer):
    runs: list[Run]
    nextCursor: str | None
    jobDeleted: bool = Field(False, description="the job was deleted; its runs stay until retention removes them")


class Notification(_Answer):
    """One webhook call of the outbox: ``pending`` (being tried), ``sent``, or ``dead`` (given up)."""

    notificationId: str
    jobId: str
    owner: str
    kind: str
    status: Literal["pending", "sent", "dead"]
    url: str
    createdAt: datetime
    attempts: int
    sentAt: datetime | None
    deadAt: datetime | None
    lastError: str | None


class NotificationList(_Answer):
    notifications: list[Notification]
    nextCursor: str | None


class RunStarted(_Answer):
    runId: str


class Identity(_Answer):
    """The calling token: the owner it acts for and its scope (``admin`` sees every owner)."""

    owner: str
    scope: Literal["read", "write", "admin"]
    admin: bool


class Health(_Answer):
    status: Literal["ok", "unavailable"]
    version: str = Field(description="the release of Chimes this API server runs, e.g. 0.2.0")
    error: str | None = Field(None, description="what is wrong, when unavailable")
    since: str | None = Field(None, description="when this process first failed to reach the database (RFC 3339)")
    failedSteps: int | None = Field(None, description="steps of this process that failed since then")
    hosts: dict[str, int] | None = Field(
        None, description="for a URL with several hosts: how many are primary, standby, refusing connections, "
                          "not answering")


class Backfilled(_Answer):
    runIds: list[str]
    created: int
    existing: int
    skipped: int = Field(description="slots recorded as skipped: a calendar the job names excludes them")


class LeaseExtended(_Answer):
    leaseExpiresAt: datetime


class QueueTier(_Answer):
    tier: str
    depth: int
    oldestEnqueuedAt: datetime | None
    lagSec: float


class Queue(_Answer):
    tiers: list[QueueTier]


class AuditActor(_Answer):
    """The token that made a change (``tokenId`` and ``tokenName`` are null for a change made with the
    command line on the database: ``owner`` is then ``operator`` and ``tokenName`` the user and host)."""

    owner: str
    tokenId: str | None
    tokenName: str | None


class AuditEntry(_Answer):
    """One change: who, when, under which request, and each changed field before and after."""

    entryId: str
    at: datetime
    action: str = Field(description="job.create, job.update, job.pause, job.resume, job.delete, job.backfill, "
                                    "run.trigger, run.rerun, run.cancel, token.create, token.revoke, cap.set, "
                                    "cap.delete, owner.update, owner.signing_secret, job.import")
    subject: str = Field(description="what changed: job ID, run ID, token ID, cap TARGET, owner NAME")
    jobId: str | None
    owner: str | None = Field(description="whose subject it is")
    actor: AuditActor
    requestId: str | None
    changes: dict[str, dict[str, Any]] = Field(description='{"field": {"before": ..., "after": ...}}; secrets '
                                                          "redacted")


class AuditList(_Answer):
    entries: list[AuditEntry]
    nextCursor: str | None


#: The success answers of each operation: (path, method) -> {status: model or None for no body}.
SUCCESS: dict[tuple[str, str], dict[str, type[BaseModel] | str | None]] = {
    ("/jobs", "post"): {"201": JobCreated, "200": JobCreated},
    ("/jobs", "get"): {"200": JobList},
    ("/jobs/{job_id}", "get"): {"200": Job},
    ("/jobs/{job_id}", "patch"): {"200": Job},
    ("/jobs/{job_id}", "delete"): {"204": None},
    ("/jobs/{job_id}/pauses", "get"): {"200": PauseList},
    ("/jobs/{job_id}/runs", "get"): {"200": RunList},
    ("/jobs/{job_id}/runs", "post"): {"202": RunStarted},
    ("/runs/{run_id}", "get"): {"200": Run},
    ("/runs/{run_id}/rerun", "post"): {"202": RunStarted},
    ("/runs/{run_id}/cancel", "post"): {"200": Run},
    ("/jobs/{job_id}/backfill", "post"): {"202": Backfilled},
    ("/runs/{run_id}/heartbeat", "post"): {"200": LeaseExtended},
    ("/runs/{run_id}/complete", "post"): {"200": Run},
    ("/queue", "get"): {"200": Queue},
    ("/notifications", "get"): {"200": NotificationList},
    ("/whoami", "get"): {"200": Identity},
    ("/audit", "get"): {"200": AuditList},
    ("/schedules/preview", "post"): {"200": SchedulePreview},
    ("/calendars", "get"): {"200": CalendarList},
    ("/calendars/{name}", "get"): {"200": Calendar},
    ("/calendars/{name}", "put"): {"200": Calendar, "201": Calendar},
    ("/calendars/{name}", "delete"): {"204": None},
    ("/healthz", "get"): {"200": Health, "503": Health},
    ("/metrics", "get"): {"200": PROMETHEUS_TEXT},
}
ERRORS = {
    "400": "malformed request (invalid JSON, a cursor this API did not return)",
    "401": "no token, or a wrong or revoked one",
    "403": "the token's scope does not allow this, or the operator does not allow it for this owner",
    "404": "not found, or owned by another team",
    "409": "conflicts with the current state",
    "412": "If-Match names a version the job no longer has (the answer's ETag is the current one)",
    "413": "request body larger than the limit",
    "422": "invalid input; the message names the field",
    "429": "too many requests (Retry-After says when to retry) or the owner's job quota is reached",
    "503": "the database cannot be reached now or did not answer in time (Retry-After says when to retry; "
           "a write may have been applied: retry it with the same Idempotency-Key)",
}
#: Answers that carry the job's ETag (its version, for If-Match on PATCH and DELETE).
WITH_ETAG = frozenset({("/jobs", "post"), ("/jobs/{job_id}", "get"), ("/jobs/{job_id}", "patch")})
ETAG_HEADER = {"ETag": {"description": "the job's version, quoted: send it as If-Match on PATCH or DELETE",
                        "schema": {"type": "string"}}}
MODELS = (Error, JobCreated, Job, JobList, Run, RunList, RunStarted, Health, Backfilled, LeaseExtended, Queue,
          NotificationList, Identity, AuditList, SchedulePreview, Calendar, CalendarList, PauseList)


def install(app: FastAPI) -> None:
    """Serve the completed document (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build(app: FastAPI) -> dict[str, Any]:
    document = get_openapi(title=app.title, version=app.version, routes=app.routes,
                           description="The Chimes REST API; see docs/api.md and docs/security.md.")
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for model in MODELS:
        _add_model(schemas, model)
    document["components"]["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer"}}
    document["security"] = [{"bearerAuth": []}]
    for path, operations in document.get("paths", {}).items():
        for method, operation in operations.items():
            _complete(path, method, operation)
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    return document


def _add_model(schemas: dict[str, Any], model: type[BaseModel]) -> None:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
    for name, definition in schema.pop("$defs", {}).items():
        schemas.setdefault(name, definition)
    schemas[model.__name__] = schema


def _ref(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}


def _complete(path: str, method: str, operation: dict[str, Any]) -> None:
    responses = operation.setdefault("responses", {})
    success = SUCCESS.get((path, method))
    if success is not None:
        for status in [s for s in responses if s.startswith("2")]:
            responses.pop(status)
        for status, model in success.items():
            answer: dict[str, Any] = {"description": "success" if status.startswith("2") else "unavailable"}
            if isinstance(model, str):
                answer["content"] = {model: {"schema": {"type": "string"}}}
            elif model is not None:
                answer["content"] = _ref(model)
            if (path, method) in WITH_ETAG:
                answer["headers"] = ETAG_HEADER
            responses[status] = answer
    if path in PUBLIC_PATHS:
        operation["security"] = []
        return
    for status, description in ERRORS.items():
        responses[status] = {"description": description, "content": _ref(Error)}
