"""Limits every request meets before a handler runs: body size (413), failed authentication per
client address and writes per token (429 with Retry-After).

Rate limits are token buckets kept in memory, so they hold per API process: behind a load balancer
with N processes, a client gets up to N times the configured rate.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chimes.api.errors import ApiError, error_body
from chimes.api.responses import JSONResponse

log = logging.getLogger("chimes.api.auth")

DEFAULT_MAX_BODY_BYTES = 1024 * 1024
# How much of an oversized body is read and thrown away before the 413 is sent (see BodySizeLimit).
DRAIN_MAX_BYTES = 64 * 1024 * 1024
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
SESSION_COOKIE = b"chimes_session"
#: The request scope's judge of the credentials it carries (judge_credential).
_GUESSES = "chimes.credential_guesses"
#: Credentials remembered per kind (counted failures, known good ones); the oldest are forgotten.
_REMEMBERED = 10_000
T = TypeVar("T")
K = TypeVar("K")


@dataclass(frozen=True, slots=True)
class LimitSettings:
    """Operator settings of the API process (``chimes api --help`` lists their flags)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Writes per token, sustained and at once; 0: no limit. High enough that no plain script meets it
    # (eight threads creating jobs as fast as one API process takes them stay far below): it is there
    # to stop a runaway client, not to pace ordinary ones. Managed schedulers allow as much by default
    # (EventBridge Scheduler: 5,000 creates a second).
    writes_per_sec: float = 5000.0
    write_burst: int = 10_000
    auth_failures_per_min: float = 10.0  # per client address, sustained
    auth_failure_burst: int = 20         # per client address, at once
    default_job_quota: int | None = 10_000  # jobs per owner without a quota of its own; None: no limit
    request_timeout_sec: float = 15.0  # then 503 with Retry-After (chimes.api.unavailable)


class RateLimiter:
    """Token buckets by key, at most ``max_keys`` of them (least recently used ones are forgotten,
    which only ever makes a limit more lenient, never stricter)."""

    def __init__(self, per_sec: float, burst: int, *, max_keys: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_sec, self.burst, self._max_keys, self._clock = per_sec, burst, max_keys, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)

    def _level(self, key: str) -> float:
        tokens, at = self._buckets.get(key, (float(self.burst), self._clock()))
        return min(float(self.burst), tokens + (self._clock() - at) * self.per_sec)

    def wait(self, key: str) -> float:
        """Seconds until ``key`` may act again; 0 when it may now (nothing is taken)."""
        level = self._level(key)
        return 0.0 if level >= 1 else (1 - level) / self.per_sec

    def take(self, key: str) -> float:
        """Take one token for ``key``: 0 when there was one, else the seconds to wait (nothing taken)."""
        level = self._level(key)
        if level < 1:
            return (1 - level) / self.per_sec
        self._buckets[key] = (level - 1, self._clock())
        self._buckets.move_to_end(key)
        while len(self._buckets) > self._max_keys:
            self._buckets.popitem(last=False)
        return 0.0

    def give_back(self, key: str) -> None:
        """Return a token taken for ``key`` (what it was taken for did not happen)."""
        if key in self._buckets:
            self._buckets[key] = (min(float(self.burst), self._level(key) + 1), self._clock())


async def judge_credential(scope: Scope, credential: str, check: Callable[[str], Awaitable[T | None]]) -> T | None:
    """``check(credential)`` (None: it does not authenticate), as a guess of the request's client
    address, whichever header, cookie or body carried it. The guess is charged to the address's
    budget of failed attempts before it is checked, in the same step as the budget is read, and
    refused with 429 when none is left: charged when its answer was sent, guesses sent at once were
    all checked before the first was counted. The charge is given back when the credential holds
    (or cannot be checked), and a credential known to hold, or counted already as failing, is not
    charged again. Called where a token is checked: only there is it known which one was tried."""
    guesses = scope.get(_GUESSES)
    if not isinstance(guesses, _Guesses):  # an app without RequestLimits (no limits to keep)
        return await check(credential)
    return await guesses.judge(credential, check)


def too_many(code: str, message: str, wait_sec: float) -> JSONResponse:
    retry_after = max(1, math.ceil(wait_sec))
    return JSONResponse(error_body(code, f"{message}; retry after {retry_after} s"), 429,
                        headers={"Retry-After": str(retry_after)})


class RequestLimits:
    """Failed authentication is counted per client address and logged; an address out of attempts
    gets 429 until its bucket refills. What counts is each credential that failed, as the code that
    checks it reports it (:func:`judge_credential`: a bearer token, a dashboard session cookie, a
    token typed into the sign-in form), charged before it is checked, and any other 401 answer once
    per presented header. A credential that keeps failing (a dashboard tab polling with an expired
    session) counts once: guessing needs new credentials, and each of those counts, whatever else
    the request carries. Writes carrying a credential (bearer token or dashboard session) are
    limited per credential."""

    def __init__(self, app: ASGIApp, settings: LimitSettings) -> None:
        self.app = app
        self.failures = RateLimiter(settings.auth_failures_per_min / 60, settings.auth_failure_burst)
        self.writes = RateLimiter(settings.writes_per_sec, settings.write_burst) if settings.writes_per_sec else None
        self.settings = settings
        self.failed: OrderedDict[tuple[str, str], None] = OrderedDict()  # (address, credential) counted
        self.good: OrderedDict[str, None] = OrderedDict()  # credentials that authenticated
        self.pending: dict[tuple[str, str], int] = {}  # charged, being checked: requests checking each

    def count_failure(self, address: str, credential: str | None, method: str, path: str) -> bool:
        """Remember ``credential`` as failing from ``address``; False when it was already."""
        key = (address, credential or "none")
        if key in self.failed:
            self.failed.move_to_end(key)
            return False
        _remember(self.failed, key)
        log.warning("authentication failed from %s: %s %s", address, method, path)
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/healthz":
            await self.app(scope, receive, send)
            return
        address = (scope.get("client") or ("unknown", 0))[0]
        wait = self.failures.wait(address)
        if wait:
            await too_many("too_many_failed_logins",
                           f"too many failed authentication attempts from {address}", wait)(scope, receive, send)
            return
        credential = _credential(scope)
        if self.writes is not None and credential is not None and scope["method"] in WRITE_METHODS:
            wait = self.writes.take(credential)
            if wait:
                s = self.settings
                message = (f"too many writes with this token: at most {s.writes_per_sec:g} a second "
                           f"(bursts of {s.write_burst})")
                await too_many("rate_limited", message, wait)(scope, receive, send)
                return

        guesses = scope[_GUESSES] = _Guesses(self, address, scope["method"], scope["path"])

        async def watching_send(message: Message) -> None:
            # No token checked, yet 401: a missing or malformed header, counted once per header.
            if message["type"] == "http.response.start" and message["status"] == 401 and not guesses.judged:
                if self.count_failure(address, credential, scope["method"], scope["path"]):
                    self.failures.take(address)
            await send(message)

        await self.app(scope, receive, watching_send)


class _Guesses:
    """The credentials one request has checked, judged against its client address's budget."""

    def __init__(self, limits: RequestLimits, address: str, method: str, path: str) -> None:
        self.limits, self.address, self.method, self.path = limits, address, method, path
        self.judged = False

    async def judge(self, credential: str, check: Callable[[str], Awaitable[T | None]]) -> T | None:
        limits, hashed = self.limits, _hash(credential.encode())
        key = (self.address, hashed)
        self.judged = True
        # Charged here, with no await between reading the budget and taking from it.
        charged = not (hashed in limits.good or key in limits.failed or key in limits.pending)
        if charged:
            wait = limits.failures.take(self.address)
            if wait:
                raise _too_many_failures(self.address, wait)
        limits.pending[key] = limits.pending.get(key, 0) + 1
        try:
            found = await check(credential)
        except BaseException:
            if charged:  # not checked: no guess was made
                limits.failures.give_back(self.address)
            raise
        finally:
            limits.pending[key] -= 1
            if not limits.pending[key]:
                del limits.pending[key]
        if found is None:
            limits.good.pop(hashed, None)  # a token revoked since
            if limits.count_failure(self.address, hashed, self.method, self.path) and not charged:
                limits.failures.take(self.address)  # a credential good before, or judged beside another
        else:
            if charged:
                limits.failures.give_back(self.address)
            limits.failed.pop(key, None)
            _remember(limits.good, hashed)
        return found


def _too_many_failures(address: str, wait: float) -> ApiError:
    """What :func:`too_many` answers an address out of attempts, to raise from a handler."""
    retry_after = max(1, math.ceil(wait))
    return ApiError(429, "too_many_failed_logins", f"too many failed authentication attempts from {address}; "
                    f"retry after {retry_after} s", headers={"Retry-After": str(retry_after)})


def _remember(seen: OrderedDict[K, None], key: K) -> None:
    seen[key] = None
    seen.move_to_end(key)
    while len(seen) > _REMEMBERED:
        seen.popitem(last=False)


def _hash(credential: bytes) -> str:
    return hashlib.sha256(credential).hexdigest()


def _credential(scope: Scope) -> str | None:
    """A stable key for the presented credential (its hash: the credential itself is never kept): the
    Authorization header, which the API reads, before the dashboard's session cookie, in whichever
    order they came."""
    cookie = None
    for name, value in scope["headers"]:
        if name == b"authorization" and value:
            return _hash(value)
        if name == b"cookie" and SESSION_COOKIE in value and cookie is None:
            cookie = _hash(value)
    return cookie


class BodySizeLimit:
    """A hard cap on request body size, enforced before any handler reads the body.

    The rest of an oversized body is read and discarded (up to DRAIN_MAX_BYTES) before the 413 is
    sent. Answering at once and closing was a broken pipe for most clients: urllib, requests and
    httpx send the whole body before they read an answer (no ``Expect: 100-continue``), so the
    server's close reset the connection under their write and they never saw the 413. A client
    that does send ``Expect: 100-continue`` is answered at once, before it sends the body.
    """

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._reject(scope, receive, send)
            return
        received = 0
        rejected = False

        async def limited_receive() -> Message:
            # Past the limit, answer 413 ourselves and tell the app the client went away; whatever
            # the app then tries to send is dropped.
            nonlocal received, rejected
            if rejected:
                return {"type": "http.disconnect"}
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                rejected = True
                await self._reject(scope, receive, send, drain=message.get("more_body", False))
                return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not rejected:
                await send(message)

        await self.app(scope, limited_receive, guarded_send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send, *, drain: bool = True) -> None:
        if drain and dict(scope["headers"]).get(b"expect", b"").lower() != b"100-continue":
            await _drain(receive)
        message = f"request body is larger than the limit of {self.max_bytes} bytes"
        await JSONResponse(error_body("payload_too_large", message, "body"), 413)(scope, receive, send)


async def _drain(receive: Receive) -> None:
    """Read the rest of the request body and drop it, up to DRAIN_MAX_BYTES (past that the
    connection is closed after the answer, as before)."""
    drained = 0
    while drained <= DRAIN_MAX_BYTES:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        drained += len(message.get("body", b""))
