"""What a call to the API can raise: :class:`ApiError` for an answer the API refused (with the HTTP
status, the stable error code, the offending field and the message of API.md "Errors"), and
:class:`ApiUnreachable` when no answer came at all."""

from __future__ import annotations

from typing import Any

import httpx


class ChimesError(Exception):
    """Every error of :mod:`chimes.client`."""


class ApiUnreachable(ChimesError):
    """No answer: the API was not listening, did not answer in time, or the connection broke."""


class ApiError(ChimesError):
    """The API answered with an error status. ``str(error)`` is the API's message, which starts with
    the field when there is one (``schedule.timezone: unknown time zone 'Mars/Base'``)."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None,
                 details: list[dict[str, Any]] | None = None, headers: httpx.Headers | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.details = details or []
        self.headers = headers or httpx.Headers()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status}, {self.code!r}, {self.message!r}, field={self.field!r})"

    @classmethod
    def from_response(cls, response: httpx.Response) -> ApiError:
        """The error an answer carries: its JSON body if it has one, else the status and text."""
        try:
            body = response.json()
        except ValueError:
            body = None
        status = response.status_code
        kind = _BY_STATUS.get(status, ApiError)
        if isinstance(body, dict) and (body.get("message") or body.get("error")):
            details = body.get("details")
            return kind(status, str(body.get("error") or "error"), str(body.get("message") or body.get("error")),
                        body.get("field"), details if isinstance(details, list) else None, response.headers)
        text = response.text.strip()[:200] or response.reason_phrase
        return kind(status, "http_error", f"HTTP {status}: {text}", None, None, response.headers)


class InvalidRequest(ApiError):
    """400 or 422: the request was malformed or a field invalid; nothing was changed."""


class Unauthorized(ApiError):
    """401: no token, or one the API does not know (revoked, mistyped)."""


class Forbidden(ApiError):
    """403: the token may not do this (a read-only token writing, a command task not allowed)."""


class NotFound(ApiError):
    """404: no such job or run, or one of another team (``code`` is ``job_deleted`` for a deleted job)."""


class Conflict(ApiError):
    """409: the run already ended, an idempotency key was reused with another body, a stale lease."""


class PreconditionFailed(ApiError):
    """412: the job changed since the version given as ``if_version``; ``current_version`` is its version now."""

    @property
    def current_version(self) -> int | None:
        tag = self.headers.get("ETag", "").strip('"')
        return int(tag) if tag.isdigit() else None


class RateLimited(ApiError):
    """429 still refused after the client's bounded waits, or a full job quota (no ``Retry-After``)."""


_BY_STATUS: dict[int, type[ApiError]] = {
    400: InvalidRequest, 422: InvalidRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound,
    409: Conflict, 412: PreconditionFailed, 429: RateLimited,
}
