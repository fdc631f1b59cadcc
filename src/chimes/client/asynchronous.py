"""The one implementation of the client: :class:`AsyncClient` and its resources (jobs, runs,
notifications). Every request goes through :meth:`AsyncClient.request`, which waits out a rate
limit and turns an error answer into an :class:`~chimes.client.errors.ApiError`.
:class:`chimes.client.Client` runs this same code on an event loop of its own."""

from __future__ import annotations

import asyncio
import builtins
import email.utils
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from datetime import datetime
from typing import Any, TypeVar
from urllib.parse import quote

import httpx

from chimes.client.errors import ApiError, ApiUnreachable, ChimesError
from chimes.client.models import (
    Backfilled,
    Calendar,
    Identity,
    Job,
    JobCreated,
    Notification,
    Page,
    Pause,
    Run,
    RunPage,
    _FromApi,
)
from chimes.jobs import JobSpec

DEFAULT_API_URL = "http://127.0.0.1:8080"
TIMEOUT_SEC = 30.0
RATE_LIMIT_RETRIES = 10      # 429s with Retry-After waited out per request before giving up
RETRY_AFTER_CAP_SEC = 60.0   # the longest single wait, whatever Retry-After says
log = logging.getLogger("chimes.client")
T = TypeVar("T", bound=_FromApi)  # Answer or Job: a union bound would lose from_api's Self
Sleep = Callable[[float], Awaitable[None]]


def retry_after(response: httpx.Response, cap: float = RETRY_AFTER_CAP_SEC) -> float | None:
    """Seconds to wait before sending a refused request again: from a 429's ``Retry-After``
    (seconds or an HTTP date), at most ``cap``; None when the answer is not one to retry (any other
    status, or a 429 without Retry-After, such as a full job quota)."""
    value = response.headers.get("Retry-After")
    if response.status_code != 429 or value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return None
    return min(max(seconds, 0.0), cap)


def _path(*parts: str) -> str:
    return "/" + "/".join(quote(str(p), safe="") for p in parts)


def _version(response: httpx.Response) -> int | None:
    tag = response.headers.get("ETag", "").strip('"')
    return int(tag) if tag.isdigit() else None


def _if_match(version: int | None) -> dict[str, str] | None:
    return {"If-Match": f'"{version}"'} if version is not None else None


class AsyncClient:
    """The Chimes API from asyncio code. ``token`` defaults to ``CHIMES_TOKEN`` and ``base_url`` to
    ``CHIMES_API_URL`` (else ``http://127.0.0.1:8080``).

    A 429 that carries ``Retry-After`` (a rate limit: nothing was done) is waited out and the same
    request sent again, at most ``rate_limit_retries`` times and ``max_retry_after`` seconds a wait;
    ``sleep`` is how it waits (``asyncio.sleep``). Use as ``async with AsyncClient() as chimes:``.
    """

    def __init__(self, base_url: str | None = None, token: str | None = None, *, timeout: float = TIMEOUT_SEC,
                 rate_limit_retries: int = RATE_LIMIT_RETRIES, max_retry_after: float = RETRY_AFTER_CAP_SEC,
                 sleep: Sleep | None = None, user_agent: str = "chimes-client",
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        token = token or os.environ.get("CHIMES_TOKEN")
        if not token:
            raise ChimesError("no API token: pass token= or set CHIMES_TOKEN")
        self.base_url = (base_url or os.environ.get("CHIMES_API_URL") or DEFAULT_API_URL).rstrip("/")
        self.timeout = timeout
        self.rate_limit_retries = rate_limit_retries
        self.max_retry_after = max_retry_after
        self._sleep = sleep or asyncio.sleep
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout, transport=transport,
                                       headers={"Authorization": f"Bearer {token}", "User-Agent": user_agent})
        self.jobs = AsyncJobs(self)
        self.runs = AsyncRuns(self)
        self.notifications = AsyncNotifications(self)
        self.calendars = AsyncCalendars(self)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def whoami(self) -> Identity:
        """The owner this token acts for and its scope."""
        return Identity.from_api(await self.call("GET", "/whoami"))

    async def call(self, method: str, path: str, *, body: Any = None, params: Mapping[str, Any] | None = None,
                   headers: Mapping[str, str] | None = None) -> Any:
        """Any endpoint: its JSON answer (None for an empty one)."""
        return _json(await self.request(method, path, body=body, params=params, headers=headers))

    async def request(self, method: str, path: str, *, body: Any = None, params: Mapping[str, Any] | None = None,
                      headers: Mapping[str, str] | None = None) -> httpx.Response:
        """Send a request; wait out rate limits; raise :class:`ApiError` for an error answer."""
        query = {k: v for k, v in (params or {}).items() if v is not None}
        response = await self._send(method, path, body, query, headers)
        for _ in range(self.rate_limit_retries):
            # A 429 with Retry-After was refused before anything was done (a rate limit), so the same
            # request is safe to send again once the wait is over, even a POST.
            wait = retry_after(response, self.max_retry_after)
            if wait is None:
                break
            log.info("the API limits this token's requests; retrying in %.1f s", wait)
            await self._sleep(wait)
            response = await self._send(method, path, body, query, headers)
        if response.status_code >= 400:
            raise ApiError.from_response(response)
        return response

    async def _send(self, method: str, path: str, body: Any, query: dict[str, Any],
                    headers: Mapping[str, str] | None) -> httpx.Response:
        try:
            return await self._http.request(method, path, json=body, params=query, headers=headers)
        except httpx.ConnectError:
            raise ApiUnreachable(
                f"cannot reach the Chimes API at {self.base_url}: is `chimes up` (or `chimes api`) running?"
            ) from None
        except httpx.TimeoutException:
            raise ApiUnreachable(f"the Chimes API at {self.base_url} did not answer in {self.timeout:.0f}s") from None
        except httpx.HTTPError as exc:
            raise ApiUnreachable(f"request to {self.base_url} failed: {exc}") from None

    async def _page(self, kind: type[T], path: str, key: str, params: Mapping[str, Any]) -> Page[T]:
        answer = await self.call("GET", path, params=params)
        return Page([kind.from_api(item) for item in answer.get(key) or []], answer.get("nextCursor"), answer)

    async def _all(self, kind: type[T], path: str, key: str, params: Mapping[str, Any]) -> AsyncIterator[T]:
        cursor: str | None = None
        seen: set[str] = set()
        while True:
            page = await self._page(kind, path, key, {**params, "cursor": cursor})
            for item in page.items:
                yield item
            cursor = page.next_cursor
            if not cursor or cursor in seen:  # an API that hands a cursor back twice would loop forever
                return
            seen.add(cursor)


def _json(response: httpx.Response) -> Any:
    if response.status_code == 204 or not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        raise ChimesError(f"the API answered {response.status_code} with a body that is not JSON") from None


def _wire(definition: JobSpec | Mapping[str, Any]) -> Any:
    return definition.to_wire() if isinstance(definition, JobSpec) else dict(definition)


def _time(value: datetime | str) -> str:
    return value.isoformat() if isinstance(value, datetime) else value


def _job_filters(tag: str | None, name_prefix: str | None, paused: bool | None, kind: str | None) -> dict[str, Any]:
    return {"tag": tag, "namePrefix": name_prefix, "paused": None if paused is None else str(paused).lower(),
            "kind": kind}


class AsyncJobs:
    """``/jobs``: create, read, list, change, pause, resume, delete, run now, backfill."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(self, definition: JobSpec | Mapping[str, Any], *,
                     idempotency_key: str | None = None) -> JobCreated:
        """Create a job from a :class:`~chimes.jobs.JobSpec` or a dict in the API's camelCase
        (validated by the API). The same ``idempotency_key`` again returns the first job
        (``created`` False)."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        response = await self._client.request("POST", "/jobs", body=_wire(definition), headers=headers)
        answer = _json(response)
        return JobCreated.from_api({**answer, "version": _version(response), "created": response.status_code == 201})

    async def get(self, job_id: str, *, preview: int | None = None) -> Job:
        """The job; with ``preview``, its next ``preview`` fire times in ``next_runs``."""
        return Job.from_api(await self._client.call("GET", _path("jobs", job_id), params={"preview": preview}))

    async def preview(self, schedule: Mapping[str, Any], *, n: int = 10,
                      after: datetime | None = None) -> list[datetime]:
        """The next ``n`` fire times of a schedule not saved yet (``POST /schedules/preview``)."""
        body = {"schedule": dict(schedule), "n": n} | ({"after": after.isoformat()} if after else {})
        answer = await self._client.call("POST", "/schedules/preview", body=body)
        return [datetime.fromisoformat(fire) for fire in answer["fires"]]

    async def page(self, *, cursor: str | None = None, limit: int | None = None, tag: str | None = None,
                   name_prefix: str | None = None, paused: bool | None = None, kind: str | None = None) -> Page[Job]:
        """One page of the caller's jobs, in creation order (an admin's: every owner's); the filters
        given (a tag, a name prefix, paused or not, ``"cron"`` or ``"at"``) all hold for each."""
        query = {"cursor": cursor, "limit": limit} | _job_filters(tag, name_prefix, paused, kind)
        return await self._client._page(Job, "/jobs", "jobs", query)

    def list(self, *, page_size: int | None = None, tag: str | None = None, name_prefix: str | None = None,
             paused: bool | None = None, kind: str | None = None) -> AsyncIterator[Job]:
        """Every job of the caller's (that the filters let through, as for :meth:`page`), following the
        cursors: ``async for job in chimes.jobs.list()``."""
        return self._client._all(Job, "/jobs", "jobs", {"limit": page_size} | _job_filters(tag, name_prefix, paused,
                                                                                          kind))

    async def update(self, job_id: str, changes: Mapping[str, Any], *, if_version: int | None = None) -> Job:
        """Change the fields given (API.md ``PATCH``). With ``if_version`` the change is made only while
        the job is at that version; else :class:`~chimes.client.errors.PreconditionFailed`."""
        answer = await self._client.call("PATCH", _path("jobs", job_id), body=dict(changes),
                                         headers=_if_match(if_version))
        return Job.from_api(answer)

    async def delete(self, job_id: str, *, if_version: int | None = None) -> None:
        """Delete the job; its runs stay listable until retention removes them."""
        await self._client.request("DELETE", _path("jobs", job_id), headers=_if_match(if_version))

    async def pause(self, job_id: str, note: str | None = None) -> Job:
        """Pause the job; ``note`` says why, recorded with the pause and who asked."""
        return await self.update(job_id, {"paused": True} if note is None else {"paused": True, "pauseNote": note})

    async def pauses(self, job_id: str, *, limit: int | None = None) -> builtins.list[Pause]:
        """The job's pauses, newest first: who paused it and why, and who resumed it."""
        answer = await self._client.call("GET", _path("jobs", job_id, "pauses"),
                                         params=None if limit is None else {"limit": limit})
        return [Pause.from_api(p) for p in answer["pauses"]]

    async def resume(self, job_id: str) -> Job:
        return await self.update(job_id, {"paused": False})

    async def run_now(self, job_id: str) -> str:
        """Start a manual run now; its run id."""
        answer = await self._client.call("POST", _path("jobs", job_id, "runs"))
        return str(answer["runId"])

    async def backfill(self, job_id: str, start: datetime | str, end: datetime | str) -> Backfilled:
        """The runs the schedule would have made in (start, end], in the past (at most 1,000)."""
        body = {"start": _time(start), "end": _time(end)}
        return Backfilled.from_api(await self._client.call("POST", _path("jobs", job_id, "backfill"), body=body))


class AsyncRuns:
    """Runs: a job's history, one run with its attempts, cancel, rerun."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def page(self, job_id: str, *, status: str | None = None, cursor: str | None = None,
                   limit: int | None = None) -> RunPage:
        """One page of a job's runs, newest scheduled time first (also a deleted job's)."""
        answer = await self._client.call("GET", _path("jobs", job_id, "runs"),
                                         params={"status": status, "cursor": cursor, "limit": limit})
        runs = [Run.from_api(item) for item in answer.get("runs") or []]
        return RunPage(runs, answer.get("nextCursor"), answer, bool(answer.get("jobDeleted")))

    def list(self, job_id: str, *, status: str | None = None, page_size: int | None = None) -> AsyncIterator[Run]:
        """Every run of the job (newest first), following the cursors."""
        return self._client._all(Run, _path("jobs", job_id, "runs"), "runs", {"status": status, "limit": page_size})

    async def get(self, run_id: str) -> Run:
        return Run.from_api(await self._client.call("GET", _path("runs", run_id)))

    async def cancel(self, run_id: str) -> Run:
        """Cancel a run that has not finished (:class:`~chimes.client.errors.Conflict` if it has)."""
        return Run.from_api(await self._client.call("POST", _path("runs", run_id, "cancel")))

    async def rerun(self, run_id: str) -> str:
        """Run that run's job again now, as a new run; its run id."""
        answer = await self._client.call("POST", _path("runs", run_id, "rerun"))
        return str(answer["runId"])


class AsyncNotifications:
    """``GET /notifications``: the webhook notifications of the caller's jobs, newest first."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def page(self, *, status: str | None = None, job_id: str | None = None, cursor: str | None = None,
                   limit: int | None = None) -> Page[Notification]:
        params = {"status": status, "jobId": job_id, "cursor": cursor, "limit": limit}
        return await self._client._page(Notification, "/notifications", "notifications", params)

    def list(self, *, status: str | None = None, job_id: str | None = None,
             page_size: int | None = None) -> AsyncIterator[Notification]:
        params = {"status": status, "jobId": job_id, "limit": page_size}
        return self._client._all(Notification, "/notifications", "notifications", params)


class AsyncCalendars:
    """``/calendars``: the caller's exclusion calendars, named by jobs in ``schedule.excludeCalendars``."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def put(self, name: str, calendar: Mapping[str, Any]) -> Calendar:
        """Create or replace: ``{"timezone": ..., "dates": [...], "windows": [{"start", "end"}]}``."""
        return Calendar.from_api(await self._client.call("PUT", _path("calendars", name), body=dict(calendar)))

    async def get(self, name: str) -> Calendar:
        return Calendar.from_api(await self._client.call("GET", _path("calendars", name)))

    async def list(self) -> list[Calendar]:
        answer = await self._client.call("GET", "/calendars")
        return [Calendar.from_api(c) for c in answer["calendars"]]

    async def delete(self, name: str) -> None:
        """Refused (:class:`~chimes.client.errors.Conflict`) while jobs name it."""
        await self._client.call("DELETE", _path("calendars", name))
