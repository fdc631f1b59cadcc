"""Reporting a run back to Chimes: ``POST /runs/{id}/heartbeat`` and ``/complete`` with the lease token.

A target that answered 202 to a ``callback`` task owns the run's outcome: it must extend the lease
(each heartbeat gives 30 s) and end the attempt. The calls need an API token of the job's owner with
scope ``write``. A stale lease token (the run was reaped, cancelled or completed) answers 409:
:class:`LeaseLost`.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from typing import Any

import httpx

__all__ = ["CallbackError", "LeaseLost", "RunReporter"]

log = logging.getLogger("chimes.receiver")

#: Tries of a ``complete`` whose answer never came or was a server error; the lease outlasts them.
COMPLETE_TRIES = 3
#: The longest error and output ``POST /runs/{id}/complete`` takes; longer ones are refused (422).
MAX_ERROR_CHARS = 4000
MAX_OUTPUT_CHARS = 4096
_RETRY_PAUSE_SEC = 0.5


class CallbackError(Exception):
    """Chimes refused a callback for another reason than the lease (401, 403, 422, ...)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class LeaseLost(CallbackError):
    """The lease token is stale: the run is no longer this target's to report (409)."""


class RunReporter:
    """The callback endpoints of one Chimes API, with one owner's token."""

    def __init__(self, api_url: str, token: str, *, http: httpx.AsyncClient | None = None,
                 timeout_sec: float = 10.0) -> None:
        self._api_url = api_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}
        self._owns_http = http is None
        self._http = http or httpx.AsyncClient(timeout=timeout_sec)

    async def heartbeat(self, run_id: str, lease_token: str) -> datetime:
        """Extend the run's lease; returns when it now expires."""
        answer = await self._post(f"/runs/{run_id}/heartbeat", {"leaseToken": lease_token})
        return datetime.fromisoformat(answer["leaseExpiresAt"])

    async def complete(self, run_id: str, lease_token: str, status: str, *, error: str | None = None,
                       output: str | None = None) -> dict[str, Any]:
        """End the attempt as ``succeeded`` or ``failed`` (a failure follows the retry policy); returns
        the run. Transport failures and 5xx answers are tried again, up to :data:`COMPLETE_TRIES` times."""
        body = {"leaseToken": lease_token, "status": status, "error": error, "output": output}
        for try_number in range(1, COMPLETE_TRIES + 1):
            try:
                return await self._post(f"/runs/{run_id}/complete", body)
            except (httpx.TransportError, _ServerError) as exc:
                if try_number == COMPLETE_TRIES:
                    raise
                log.warning("completing run %s failed (%s); trying again", run_id, exc, extra={"run_id": run_id})
                await asyncio.sleep(_RETRY_PAUSE_SEC * try_number)
        raise AssertionError("unreachable")

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = await self._http.post(self._api_url + path, json=body, headers=self._headers)
        if answer.status_code == 200:
            result: dict[str, Any] = answer.json()
            return result
        message = _message(answer)
        if answer.status_code == 409:
            raise LeaseLost(409, message)
        if answer.status_code >= 500:
            raise _ServerError(answer.status_code, message)
        raise CallbackError(answer.status_code, message)

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()


class _ServerError(CallbackError):
    pass


def _message(answer: httpx.Response) -> str:
    try:
        return str(answer.json().get("message", answer.text))
    except ValueError:
        return answer.text[:200]
