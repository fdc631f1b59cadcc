"""HTTP tasks: call a webhook/URL and judge the run by the response status.

One pooled ``aiohttp.ClientSession`` is shared by all runs of a worker so that
thousands of concurrent webhook calls reuse connections instead of paying a TCP
(and TLS) handshake each, and so the open-socket count stays bounded.

Its connector applies the egress (SSRF) policy to every address it connects to, and every request
is signed with the owner's signing secret (``X-Chimes-Signature``, chimes.security.signing).

Redirects are followed here, not by aiohttp, which would carry every header, secret ones included,
to whatever origin the target names. A hop to another origin (scheme, host and port) keeps only
Chimes' own headers: the task's headers and the signature are for the origin the team configured.
"""

from __future__ import annotations

import asyncio
import errno
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import aiohttp
import orjson
from multidict import CIMultiDict
from yarl import URL

from chimes.security.signing import SIGNATURE_HEADER, signature_header
from chimes.security.ssrf import EgressPolicy, GuardedConnector, egress_error
from chimes.tracing import traceparent
from chimes.worker.executors import (
    OUTPUT_TAIL_BYTES,
    OutputTail,
    TaskContext,
    TaskOutcome,
    format_seconds,
    rfc3339_utc,
    short_error,
)

__all__ = ["HTTP_READ_LIMIT_BYTES", "MAX_REDIRECTS", "USER_AGENT", "HttpExecutor", "build_headers"]

#: Most response bytes read per run: a streaming or huge response must not hold the run open.
HTTP_READ_LIMIT_BYTES = 64 * 1024
MAX_REDIRECTS = 10  # as aiohttp's and most clients' default
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_READ_CHUNK = 16 * 1024
_RESERVED_PREFIX = "x-chimes-"


def _package_version() -> str:
    try:
        return version("chimes")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"


USER_AGENT = f"chimes/{_package_version()}"


def build_headers(user_headers: dict[str, Any] | None, ctx: TaskContext) -> CIMultiDict[str]:
    """Merge task headers with ours; ours win so receivers can trust them for dedupe.

    ``User-Agent`` is only a default the task may override; ``Idempotency-Key``,
    ``traceparent`` and the whole ``X-Chimes-*`` namespace are reserved (case-insensitively).
    """
    headers: CIMultiDict[str] = CIMultiDict({"User-Agent": USER_AGENT})
    for name, value in (user_headers or {}).items():
        name = str(name)
        if name.lower().startswith(_RESERVED_PREFIX) or name.lower() in ("idempotency-key", "traceparent"):
            continue
        headers[name] = str(value)
    headers["Idempotency-Key"] = ctx.run_id
    headers["X-Chimes-Run-Id"] = ctx.run_id
    headers["X-Chimes-Job-Id"] = ctx.job_id
    headers["X-Chimes-Attempt"] = str(int(ctx.attempt))
    headers["X-Chimes-Scheduled-At"] = rfc3339_utc(ctx.scheduled_at)
    headers["traceparent"] = traceparent(ctx.run_id, ctx.attempt)  # the run's trace (chimes.tracing)
    if ctx.lease_token is not None:
        headers["X-Chimes-Lease-Token"] = ctx.lease_token
    return headers


def _encode_body(body: Any, headers: CIMultiDict[str]) -> bytes | None:
    """Serialise the task body; a Content-Type given by the task is respected."""
    if body is None:
        return None
    if isinstance(body, str):
        headers.setdefault("Content-Type", "text/plain; charset=utf-8")
        return body.encode("utf-8")
    headers.setdefault("Content-Type", "application/json")
    return orjson.dumps(body)


def _connection_error(exc: aiohttp.ClientError) -> str:
    """Short reason for a transport failure, naming 'connection refused' explicitly (the common case)."""
    os_error = getattr(exc, "os_error", None)
    if isinstance(os_error, ConnectionRefusedError) or getattr(os_error, "errno", None) == errno.ECONNREFUSED:
        return short_error(f"connection refused: {type(exc).__name__}: {exc}")
    return short_error(f"{type(exc).__name__}: {exc}")


def _for_another_origin(headers: CIMultiDict[str], ctx: TaskContext) -> CIMultiDict[str]:
    """Chimes' own headers only (and the body's type): no task header, secret or not, no signature."""
    kept = build_headers(None, ctx)
    if "Content-Type" in headers:
        kept["Content-Type"] = headers["Content-Type"]
    return kept


async def _outcome(resp: aiohttp.ClientResponse, task: dict[str, Any], ctx: TaskContext) -> TaskOutcome:
    tail = OutputTail(OUTPUT_TAIL_BYTES)
    while tail.total_bytes < HTTP_READ_LIMIT_BYTES:
        chunk = await resp.content.read(min(_READ_CHUNK, HTTP_READ_LIMIT_BYTES - tail.total_bytes))
        if not chunk:
            break
        tail.feed(chunk)
    output = tail.text(resp.charset or "utf-8")
    if resp.status == 202 and task.get("callback") and ctx.lease_token is not None:
        return TaskOutcome(True, None, output, pending=True)
    if 200 <= resp.status < 300:
        return TaskOutcome(True, None, output)
    return TaskOutcome(False, f"HTTP {resp.status}", output)


class HttpExecutor:
    """Runs ``{"type": "http"}`` tasks over one lazily created, pooled client session."""

    def __init__(self, *, max_connections: int = 1000, egress: EgressPolicy | None = None) -> None:
        self._max_connections = max_connections
        self._egress = egress or EgressPolicy.build()
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        # Created on first use, inside the running loop: aiohttp binds sessions to a loop.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=GuardedConnector(self._egress, limit=self._max_connections),
                cookie_jar=aiohttp.DummyCookieJar(),  # runs must not leak state into each other
            )
        return self._session

    async def run(self, task: dict[str, Any], ctx: TaskContext) -> TaskOutcome:
        """Perform the request; 2xx is success, everything else a failed outcome (never raises)."""
        try:
            return await self._request(task, ctx)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            return TaskOutcome(False, f"timed out after {format_seconds(ctx.timeout_sec)}s")
        except aiohttp.ClientError as exc:
            refusal = egress_error(exc)
            return TaskOutcome(False, short_error(refusal) if refusal else _connection_error(exc))
        except Exception as exc:  # bad URL, unserialisable body, ...: a failed run, not a worker crash
            return TaskOutcome(False, short_error(f"{type(exc).__name__}: {exc}"))

    async def _request(self, task: dict[str, Any], ctx: TaskContext) -> TaskOutcome:
        headers = build_headers(task.get("headers"), ctx)
        data = _encode_body(task.get("body"), headers)
        if ctx.signing_secret is not None:  # fresh on every attempt: targets refuse old timestamps
            headers[SIGNATURE_HEADER] = signature_header(ctx.signing_secret, int(time.time()), data or b"")
        method = str(task.get("method") or "GET").upper()
        url = URL(str(task["url"]))
        timeout = aiohttp.ClientTimeout(total=ctx.timeout_sec)
        async with asyncio.timeout(ctx.timeout_sec):  # every hop, connect, send and body read together
            for _ in range(MAX_REDIRECTS + 1):
                async with self._get_session().request(
                    method, url, headers=headers, data=data, timeout=timeout, allow_redirects=False
                ) as resp:
                    location = resp.headers.get("Location") if resp.status in _REDIRECT_STATUSES else None
                    if location is None:
                        return await _outcome(resp, task, ctx)
                    status = resp.status
                following = url.join(URL(location))
                if following.scheme not in ("http", "https"):
                    return TaskOutcome(False, short_error(f"HTTP {status}: redirect to an unsupported URL {location}"))
                if status == 303 or (status in (301, 302) and method == "POST"):  # as every client does
                    method = "HEAD" if method == "HEAD" else "GET"
                    data = None
                    headers.popall("Content-Type", None)
                if following.origin() != url.origin():
                    headers = _for_another_origin(headers, ctx)
                url = following
        return TaskOutcome(False, f"more than {MAX_REDIRECTS} redirects")

    async def close(self) -> None:
        """Close pooled connections; a later ``run`` would open a fresh session."""
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()
