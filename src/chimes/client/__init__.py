"""A typed Python client for the Chimes REST API (docs/client.md).

    from chimes.client import Client

    with Client("http://127.0.0.1:8080", token) as chimes:
        created = chimes.jobs.create({"name": "nightly", "schedule": {"cron": "0 2 * * *"},
                                      "task": {"type": "http", "url": "https://reports.internal/run"}})
        for run in chimes.runs.list(created.job_id, status="failed"):
            print(run.run_id, run.error)

:class:`AsyncClient` is the same with ``await`` and ``async for``. There is one implementation: the
async one (:mod:`chimes.client.asynchronous`); :class:`Client` runs it on an event loop thread of
its own (:mod:`chimes.client.blocking`), so a fix or a new endpoint is written once and both get it.
Answers are pydantic models (:mod:`chimes.client.models`); errors are :class:`ApiError` subclasses
carrying the HTTP status, the API's error code, the field and the message.
"""

from chimes.client.asynchronous import AsyncClient
from chimes.client.blocking import Client
from chimes.client.errors import (
    ApiError,
    ApiUnreachable,
    ChimesError,
    Conflict,
    Forbidden,
    InvalidRequest,
    NotFound,
    PreconditionFailed,
    RateLimited,
    Unauthorized,
)
from chimes.client.models import (
    Attempt,
    Backfilled,
    Identity,
    Job,
    JobCreated,
    LastRun,
    Notification,
    Page,
    Pause,
    Run,
    RunPage,
)
from chimes.jobs import JobSpec

__all__ = [
    "ApiError", "ApiUnreachable", "AsyncClient", "Attempt", "Backfilled", "ChimesError", "Client", "Conflict",
    "Forbidden", "Identity", "InvalidRequest", "Job", "JobCreated", "JobSpec", "LastRun", "NotFound", "Notification",
    "Page", "Pause", "PreconditionFailed", "RateLimited", "Run", "RunPage", "Unauthorized",
]
