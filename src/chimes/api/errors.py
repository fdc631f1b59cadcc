"""Errors as the API answers them: JSON that names the offending field, with the right status."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from chimes.api.responses import JSONResponse
from chimes.jobs import UNION_TAGS
from chimes.security.storable import storable_problem

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, field: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field, self.headers = status, code, message, field, headers


def not_found(what: str) -> ApiError:
    return ApiError(404, "not_found", f"{what} not found")


def refuse_unstorable(**query: str | None) -> None:
    """422 naming the query parameter whose text PostgreSQL cannot compare (a NUL, a lone surrogate),
    before it reaches a statement."""
    for name, value in query.items():
        problem = None if value is None else storable_problem(value)
        if problem is not None:
            raise ApiError(422, "invalid_request", f"{name}: {problem}", name)


def error_body(code: str, message: str, field: str | None = None,
               details: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"error": code, "message": message, "field": field}
    if details is not None:
        body["details"] = details
    return body


def field_path(loc: Sequence[int | str]) -> str:
    """('body', 'task', 'http', 'url') -> 'task.url': drop the 'body' root and union member tags."""
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    kept = [
        part for i, part in enumerate(parts)
        if not (i > 0 and part in UNION_TAGS.get(parts[i - 1], ()))
    ]
    return ".".join(kept) or "body"


def _message(error: Mapping[str, Any]) -> str:
    text = str(error.get("msg", "invalid value"))
    text = text.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if error.get("type") == "timezone_aware":
        return "must be an RFC 3339 time with an offset, e.g. 2026-12-01T09:00:00Z"
    if error.get("type") == "extra_forbidden":
        return "unknown field"
    if error.get("type") == "json_invalid":
        return "request body is not valid JSON"
    return text


def validation_response(errors: Sequence[Mapping[str, Any]]) -> JSONResponse:
    details = [{"field": field_path(e.get("loc", ())), "message": _message(e)} for e in errors]
    first = details[0] if details else {"field": "body", "message": "invalid request"}
    status = 400 if any(e.get("type") == "json_invalid" for e in errors) else 422
    return JSONResponse(
        error_body("invalid_request", f"{first['field']}: {first['message']}", first["field"], details),
        status_code=status,
    )


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc.code, exc.message, exc.field), exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _request_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_response(exc.errors())

    @app.exception_handler(ValidationError)
    async def _model_invalid(_: Request, exc: ValidationError) -> JSONResponse:
        return validation_response(exc.errors())

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse(error_body("internal_error", "internal error; nothing was changed"), 500)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(error_body(code, str(exc.detail)), exc.status_code)
