"""HTTP tasks: call a webhook/URL and judge the run by the response status.

The calls go over the worker's own kept-alive connections (chimes.worker.tasks.connections). Runs
reuse pooled connections instead of paying a TCP (and TLS) handshake each, but never another
owner's: each owner has its own pool. A connection kept alive after one team's request must not
carry the next team's, since whatever the first request left on it (a framing trick the target
reads differently from the client) would swallow the second, secret headers included. Owners' pools
are bounded in number, and one idle for a minute is closed.

The egress (SSRF) policy judges a host name before it is looked up, and every address a connection
is opened to after the lookup; every request is signed with the owner's signing secret
(``X-Chimes-Signature``, chimes.security.signing).

A task cannot set the framing and connection headers (chimes.security.headers): the API refuses
them and they are dropped here again for rows written around it. The lease token goes only to a
task that uses callbacks, and only to its own origin.

Redirects are followed here, one hop at a time: a client that followed them itself would carry
every header, secret ones included, to whatever origin the target names. A hop to another origin
(scheme, host and port) keeps only Chimes' own headers: the task's headers and the signature are
for the origin the team configured.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import math
import time
from collections import OrderedDict
from importlib.metadata import PackageNotFoundError, version
from typing import Any
from urllib.parse import urljoin

import orjson
from yarl import URL

from chimes.jobs import HTTP_TASK_METHODS
from chimes.security.headers import forbidden_header, header_value_problem, is_header_name
from chimes.security.signing import SIGNATURE_HEADER, signature_header
from chimes.security.ssrf import EgressPolicy, outgoing_request
from chimes.tracing import traceparent
from chimes.worker.tasks.common import (
    OUTPUT_TAIL_BYTES,
    Outcome,
    OutputTail,
    TaskContext,
    format_seconds,
    rfc3339_utc,
    short_error,
)
from chimes.worker.tasks.connections import CallError, ConnectionPool, Reply

__all__ = ["HTTP_READ_LIMIT_BYTES", "MAX_OWNER_POOLS", "MAX_REDIRECTS", "OWNER_POOL_IDLE_SEC", "USER_AGENT",
           "Headers", "HttpExecutor", "OwnerPool", "build_headers"]

log = logging.getLogger(__name__)

#: Most response bytes read per run: a streaming or huge response must not hold the run open.
HTTP_READ_LIMIT_BYTES = 64 * 1024
MAX_REDIRECTS = 10  # as most clients' default
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_RESERVED_PREFIX = "x-chimes-"
#: Owners whose connection pools a worker keeps; beyond it the least recently used idle pool closes.
MAX_OWNER_POOLS = 256
#: An owner's pool unused this long is closed, with the connections it kept alive.
OWNER_POOL_IDLE_SEC = 60.0
MAX_REMEMBERED_HOSTS = 4096  # host names whose egress verdict is kept (then they are judged afresh)


def _package_version() -> str:
    try:
        return version("chimes")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"


USER_AGENT = f"chimes/{_package_version()}"


#: A request's headers: by the lowered name, the name as sent and its value. One entry a name, whatever
#: its case, as HTTP compares names; a plain dict, as a run's call makes one.
Headers = dict[str, tuple[str, str]]

_RESERVED_NAMES = frozenset({"idempotency-key", "traceparent"})


def build_headers(user_headers: dict[str, Any] | None, ctx: TaskContext, *, lease_token: bool = False) -> Headers:
    """Merge task headers with ours; ours win so receivers can trust them for dedupe.

    ``User-Agent`` is only a default the task may override; ``Idempotency-Key``,
    ``traceparent`` and the whole ``X-Chimes-*`` namespace are reserved (case-insensitively), and
    framing and connection headers are the client's (dropped). ``X-Chimes-Lease-Token`` is added
    only with ``lease_token``: for a task that reports through the callbacks, on its own origin.
    """
    headers: Headers = {"user-agent": ("User-Agent", USER_AGENT)}
    for name, value in (user_headers or {}).items():
        name = str(name)
        lowered = name.lower()
        if lowered.startswith(_RESERVED_PREFIX) or lowered in _RESERVED_NAMES:
            continue
        if forbidden_header(name):  # refused by the API; a row written around it must not smuggle
            log.warning("dropped header %r of job %s: tasks may not set it", name, ctx.job_id,
                        extra={"run_id": ctx.run_id, "job_id": ctx.job_id})
            continue
        headers[lowered] = (name, str(value))
    run_id = ctx.run_id
    headers["idempotency-key"] = ("Idempotency-Key", run_id)
    headers["x-chimes-run-id"] = ("X-Chimes-Run-Id", run_id)
    headers["x-chimes-job-id"] = ("X-Chimes-Job-Id", ctx.job_id)
    headers["x-chimes-attempt"] = ("X-Chimes-Attempt", str(int(ctx.attempt)))
    headers["x-chimes-scheduled-at"] = ("X-Chimes-Scheduled-At", rfc3339_utc(ctx.scheduled_at))
    headers["traceparent"] = ("traceparent", traceparent(run_id, ctx.attempt))  # the run's trace (chimes.tracing)
    if lease_token and ctx.lease_token is not None:
        headers["x-chimes-lease-token"] = ("X-Chimes-Lease-Token", ctx.lease_token)
    return headers


def _header_problem(headers: Headers, user_headers: dict[str, Any] | None) -> str | None:
    """The first header the task set (and ``build_headers`` kept) whose name or value cannot be sent.
    Chimes' own values (ids, numbers, a timestamp, hex digits) are never checked: they cannot hold one."""
    for name in user_headers or ():
        kept = headers.get(str(name).lower())
        if kept is not None:
            if not is_header_name(kept[0]):
                return f"header name {kept[0]!r} is not a token (letters, digits and !#$%&'*+-.^_`|~)"
            problem = header_value_problem(kept[1])
            if problem is not None:
                return f"header {str(name)!r} {problem}"
    return None


def _encode_body(body: Any, headers: Headers) -> bytes | None:
    """Serialise the task body; a Content-Type given by the task is respected."""
    if body is None:
        return None
    if isinstance(body, str):
        headers.setdefault("content-type", ("Content-Type", "text/plain; charset=utf-8"))
        return body.encode("utf-8")
    headers.setdefault("content-type", ("Content-Type", "application/json"))
    return orjson.dumps(body)


def _posts(method: str, data: bytes | None) -> bool:
    """Whether the request carries a body, an empty one included (``Content-Length: 0``): one with
    data, and every POST, PUT and PATCH; never a HEAD."""
    return method != "HEAD" and (data is not None or method in ("POST", "PUT", "PATCH"))


def _request(method: str, target: str, host: str, headers: Headers, data: bytes | None) -> bytes:
    """The request as written on the connection: its line, its headers and its body. Framing and
    connection headers are never the task's (build_headers); ``Host`` and ``Content-Length`` are
    set here."""
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n"]
    lines += [f"{name}: {value}\r\n" for name, value in headers.values()]
    if "accept" not in headers:
        lines.append("Accept: */*\r\n")
    if "accept-encoding" not in headers:
        lines.append("Accept-Encoding: gzip, deflate\r\n")  # decoded before the output tail sees it
    if _posts(method, data):
        lines.append(f"Content-Length: {len(data) if data else 0}\r\n\r\n")
        return "".join(lines).encode("ascii") + (data or b"")
    lines.append("\r\n")
    return "".join(lines).encode("ascii")


@functools.lru_cache(maxsize=256)  # a target answers with the same few content types
def _charset(content_type: str | None) -> str:
    for param in (content_type or "").split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip(' "'):
            return value.strip(' "')
    return "utf-8"


def _call_error(exc: CallError) -> str:
    """Short reason for a call that failed below HTTP: the egress refusal, or what failed, naming
    'connection refused' explicitly (the common case)."""
    if exc.refusals and exc.os_errno in (0, errno.EACCES):
        return short_error(f"refused by egress policy: {exc.refusals[0]}")
    if exc.os_errno == errno.ECONNREFUSED:
        return short_error(f"connection refused: {exc}")
    return short_error(str(exc))


def _for_another_origin(headers: Headers, ctx: TaskContext) -> Headers:
    """Chimes' own headers only (and the body's type): no task header, secret or not, no signature."""
    kept = build_headers(None, ctx)
    if "content-type" in headers:
        kept["content-type"] = headers["content-type"]
    return kept


def _outcome(reply: Reply, tail: OutputTail, task: dict[str, Any], ctx: TaskContext) -> Outcome:
    output = tail.text(_charset(reply.content_type))
    if reply.status == 202 and task.get("callback") and ctx.lease_token is not None:
        return Outcome.accepted(output)
    if 200 <= reply.status < 300:
        return Outcome.success(output)
    return Outcome.failure(f"HTTP {reply.status}", output)


class OwnerPool:
    """One owner's connections (a :class:`ConnectionPool`, made inside the running loop on first
    use), the calls it carries and when it was last used."""

    def __init__(self, policy: EgressPolicy, max_connections: int) -> None:
        self._policy = policy
        self._max_connections = max_connections
        self.connections: ConnectionPool | None = None
        self.closed = False
        self.in_flight = 0
        self.last_used = 0.0

    def pool(self) -> ConnectionPool:
        if self.connections is None:
            self.connections = ConnectionPool(self._policy, max_connections=self._max_connections)
        return self.connections

    @property
    def open_connections(self) -> int:
        return self.connections.open_connections if self.connections is not None else 0

    def close(self) -> None:
        self.closed = True
        if self.connections is not None:
            self.connections.close()


class HttpExecutor:
    """Runs ``{"type": "http"}`` tasks over pooled connections, a pool per owner, made on first use."""

    def __init__(self, *, max_connections: int = 1000, egress: EgressPolicy | None = None,
                 max_owner_pools: int = MAX_OWNER_POOLS, owner_pool_idle_sec: float = OWNER_POOL_IDLE_SEC) -> None:
        self._max_connections = max_connections
        self._egress = egress or EgressPolicy.build()
        self._max_owner_pools = max_owner_pools
        self._owner_pool_idle_sec = owner_pool_idle_sec
        self._pools: OrderedDict[str, OwnerPool] = OrderedDict()  # least recently used first
        self._next_idle_check = math.inf  # monotonic: when a pool may be idle for long enough, at the earliest
        self._host_refusals: dict[str, str | None] = {}  # the policy's verdict on a host name, which it never changes

    def pool_of(self, owner: str) -> OwnerPool | None:
        """The open pool that carries ``owner``'s runs, if there is one."""
        pool = self._pools.get(owner)
        return pool if pool is not None and not pool.closed else None

    def _acquire(self, owner: str) -> OwnerPool:
        pool = self._pools.get(owner)
        if pool is None or pool.closed:
            pool = self._pools[owner] = OwnerPool(self._egress, self._max_connections)
        self._pools.move_to_end(owner)
        pool.in_flight += 1
        return pool

    def _release(self, pool: OwnerPool) -> None:
        pool.in_flight -= 1
        pool.last_used = time.monotonic()
        if not pool.in_flight:
            self._next_idle_check = min(self._next_idle_check, pool.last_used + self._owner_pool_idle_sec)

    def _close_idle_pools(self) -> None:
        """Close pools unused for ``owner_pool_idle_sec``, and the least recently used idle ones
        beyond ``max_owner_pools``; a pool with a request in flight stays. Called only when one may be
        closed (the test before its call in :meth:`run`), not on every request."""
        now = time.monotonic()
        excess = len(self._pools) - self._max_owner_pools
        self._next_idle_check = math.inf
        for owner, pool in list(self._pools.items()):
            if pool.in_flight:
                continue
            if excess > 0 or now - pool.last_used > self._owner_pool_idle_sec:
                self._pools.pop(owner).close()
                excess -= 1
            else:
                self._next_idle_check = min(self._next_idle_check, pool.last_used + self._owner_pool_idle_sec)

    def _host_refusal(self, host: str) -> str | None:
        try:
            return self._host_refusals[host]
        except KeyError:
            if len(self._host_refusals) >= MAX_REMEMBERED_HOSTS:
                self._host_refusals.clear()
            refusal = self._host_refusals[host] = self._egress.host_refusal(host)
            return refusal

    async def run(self, task: dict[str, Any], ctx: TaskContext) -> Outcome:
        """Perform the request; 2xx is success, everything else a failed outcome (never raises)."""
        # One coroutine from here to the transfer (_send), not one per step: each layer is a frame
        # made per run and walked again at every resume.
        try:
            user_headers = task.get("headers")
            headers = build_headers(user_headers, ctx, lease_token=bool(task.get("callback")))
            problem = _header_problem(headers, user_headers) if user_headers else None
            if problem is not None:  # refused by the API; a row written around it fails clearly
                return Outcome.failure(short_error(problem))
            # Only when a pool may be closed: there are too many, or one has been idle long enough (the
            # earliest such moment is kept as pools are released). Tested here, inline: this runs per call.
            if len(self._pools) > self._max_owner_pools or time.monotonic() > self._next_idle_check:
                self._close_idle_pools()
            pool = self._acquire(ctx.owner)
            try:
                return await self._send(pool.pool(), task, ctx, headers)
            finally:
                self._release(pool)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            return Outcome.failure(f"timed out after {format_seconds(ctx.timeout_sec)}s")
        except CallError as exc:
            return Outcome.failure(_call_error(exc))
        except Exception as exc:  # bad URL, unserialisable body, ...: a failed run, not a worker crash
            return Outcome.failure(short_error(f"{type(exc).__name__}: {exc}"))

    async def _send(self, pool: ConnectionPool, task: dict[str, Any], ctx: TaskContext,
                    headers: Headers) -> Outcome:
        method = str(task.get("method") or "GET").upper()
        if method not in HTTP_TASK_METHODS:  # refused by the API; a row written around it fails clearly
            allowed = ", ".join(sorted(HTTP_TASK_METHODS))
            return Outcome.failure(short_error(f"method {method!r} is not one of {allowed}"))
        data = _encode_body(task.get("body"), headers)
        if ctx.signing_secret is not None:  # fresh on every attempt: targets refuse old timestamps
            signature = signature_header(ctx.signing_secret, int(time.time()), data or b"")
            headers["x-chimes-signature"] = (SIGNATURE_HEADER, signature)
        try:  # refused by the API; a row written around it fails clearly
            target = outgoing_request(str(task["url"]))
        except ValueError as exc:
            return Outcome.failure(short_error(f"cannot call {task['url']}: {exc}"))
        deadline = time.monotonic() + ctx.timeout_sec  # every hop, connect, send and body read together
        for _ in range(MAX_REDIRECTS + 1):
            refusal = self._host_refusal(target.host)
            if refusal is not None:  # a denied name is not even looked up
                return Outcome.failure(short_error(f"refused by egress policy: {refusal}"))
            if deadline <= time.monotonic():
                raise TimeoutError
            tail = OutputTail(OUTPUT_TAIL_BYTES)

            def on_body(chunk: bytes, tail: OutputTail = tail) -> bool:
                tail.feed(chunk)
                return tail.total_bytes < HTTP_READ_LIMIT_BYTES

            request = _request(method, target.path, target.host_header, headers, data)
            reply = await pool.perform(target.origin, request, on_body, deadline, head=method == "HEAD")
            if reply.status not in _REDIRECT_STATUSES or not reply.location:
                return _outcome(reply, tail, task, ctx)
            redirect_url = urljoin(target.url, reply.location)
            if URL(redirect_url).scheme not in ("http", "https"):
                return Outcome.failure(short_error(
                    f"HTTP {reply.status}: redirect to an unsupported URL {redirect_url}"))
            try:
                following = outgoing_request(redirect_url)
            except ValueError as exc:
                return Outcome.failure(short_error(f"HTTP {reply.status}: redirect to {redirect_url}: {exc}"))
            if reply.status == 303 or (reply.status in (301, 302) and method == "POST"):  # as every client does
                method = "HEAD" if method == "HEAD" else "GET"
                data = None
                headers.pop("content-type", None)
            if following.origin != target.origin:
                headers = _for_another_origin(headers, ctx)
            target = following
        return Outcome.failure(f"more than {MAX_REDIRECTS} redirects")

    async def close(self) -> None:
        """Close every owner's pooled connections; a later ``run`` opens fresh pools."""
        pools, self._pools = list(self._pools.values()), OrderedDict()
        for pool in pools:
            pool.close()
