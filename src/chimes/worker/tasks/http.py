"""HTTP tasks: call a webhook/URL and judge the run by the response status.

The calls go through libcurl (chimes.worker.tasks.curl). Runs reuse pooled connections instead of
paying a TCP (and TLS) handshake each, but never another owner's: each owner has its own pool (a
libcurl connection cache). A connection kept alive after one team's request must not carry the next
team's, since whatever the first request left on it (a framing trick the target reads differently
from the client) would swallow the second, secret headers included. Owners' pools are bounded in
number, and one idle for a minute is closed.

The egress (SSRF) policy judges a host name before it is looked up, and every address a connection
is opened to after the lookup; every request is signed with the owner's signing secret
(``X-Chimes-Signature``, chimes.security.signing).

A task cannot set the framing and connection headers (chimes.security.headers): the API refuses
them and they are dropped here again for rows written around it. The lease token goes only to a
task that uses callbacks, and only to its own origin.

Redirects are followed here, not by libcurl, which would carry every header, secret ones included,
to whatever origin the target names. A hop to another origin (scheme, host and port) keeps only
Chimes' own headers: the task's headers and the signature are for the origin the team configured.

A reply is read to its end, up to chimes.worker.tasks.curl.MAX_REPLY_BYTES, keeping only its last
:data:`OUTPUT_TAIL_BYTES` characters: a reply cut short, past the bound or otherwise broken fails the
run, saying what the target did.
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

import orjson
import pycurl
from yarl import URL

from chimes.jobs import HTTP_TASK_METHODS
from chimes.security.headers import forbidden_header, header_value_problem, is_header_name
from chimes.security.signing import SIGNATURE_HEADER, signature_header
from chimes.security.ssrf import USER_INFO_REFUSED, EgressPolicy, outgoing_request
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
from chimes.worker.tasks.curl import CurlError, CurlPool, Reply

__all__ = ["LANE_CALLS", "MAX_LANES", "MAX_OWNER_POOLS", "MAX_REDIRECTS", "OWNER_POOL_IDLE_SEC", "USER_AGENT",
           "Headers", "HttpExecutor", "OwnerPool", "build_headers", "header_lines"]

log = logging.getLogger(__name__)

MAX_REDIRECTS = 10  # as most clients' default
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_RESERVED_PREFIX = "x-chimes-"
#: Owners whose connection pools a worker keeps; beyond it the least recently used idle pool closes.
MAX_OWNER_POOLS = 256
#: An owner's pool unused this long is closed, with the connections it kept alive.
OWNER_POOL_IDLE_SEC = 60.0
#: An owner's calls go over lanes, each a libcurl multi handle with a connection cache of its own.
#: To reuse a kept-alive connection libcurl walks its cache's connections to the target one by one:
#: with 200 calls at once to one host that walk was a twentieth of a call's instructions
#: (docs/benchmarks.md, "An owner's calls over lanes"). A lane is added once every lane carries
#: LANE_CALLS calls, up to MAX_LANES, each with an even part of the owner's connections.
LANE_CALLS = 32
MAX_LANES = 8
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


def header_lines(headers: Headers) -> list[str]:
    """The request's headers as libcurl takes them: ``"X;"`` sends X with an empty value."""
    return [f"{name}: {value}" if value else f"{name};" for name, value in headers.values()]


@functools.lru_cache(maxsize=256)  # a target answers with the same few content types
def _charset(content_type: str | None) -> str:
    for param in (content_type or "").split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip(' "'):
            return value.strip(' "')
    return "utf-8"


def _call_error(exc: CurlError, timeout_sec: float) -> str:
    """Short reason for a call that failed below HTTP: the egress refusal, a timeout, or libcurl's
    own words, naming 'connection refused' explicitly (the common case)."""
    if exc.refusals and exc.code == pycurl.E_COULDNT_CONNECT:
        return short_error(f"refused by egress policy: {exc.refusals[0]}")
    if exc.code == pycurl.E_OPERATION_TIMEDOUT:
        return f"timed out after {format_seconds(timeout_sec)}s"
    if exc.code == pycurl.E_COULDNT_CONNECT and exc.os_errno == errno.ECONNREFUSED:
        return short_error(f"connection refused: {exc}")
    return short_error(str(exc) or f"libcurl error {exc.code}")


def _shown(url: str, problem: ValueError) -> str:
    """``url`` as a run's error names it: not at all when it carries user info, a password maybe."""
    return "a URL with user info" if str(problem) == USER_INFO_REFUSED else url


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
    """One owner's connections: its lanes (a :class:`CurlPool` each), the calls it carries and when it
    was last used. A call takes the first lane that carries fewer than :data:`LANE_CALLS`, so that a
    light load keeps to one lane and its kept-alive connections."""

    def __init__(self, policy: EgressPolicy, max_connections: int) -> None:
        self._policy = policy
        self._most_lanes = max(1, min(MAX_LANES, max_connections // LANE_CALLS))
        self._lane_connections = max(1, max_connections // self._most_lanes)
        self.lanes: list[CurlPool] = []
        self.closed = False
        self.in_flight = 0  # the lanes' in_flight together, counted as calls start and end: read per call
        self.last_used = 0.0

    @property
    def watched_sockets(self) -> int:
        return sum(lane.watched_sockets for lane in self.lanes)

    def another_lane(self) -> CurlPool:
        """Every lane carries LANE_CALLS calls or more: a new one, made inside the running loop (whose
        readers and timers drive it), or the least busy once there are as many as may be."""
        if len(self.lanes) < self._most_lanes:
            lane = CurlPool(self._policy, max_connections=self._lane_connections)
            self.lanes.append(lane)
            return lane
        return min(self.lanes, key=lambda lane: lane.in_flight)

    def close(self) -> None:
        self.closed = True
        for lane in self.lanes:
            lane.close()


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

    def _acquire(self, owner: str) -> tuple[OwnerPool, CurlPool]:
        pool = self._pools.get(owner)
        if pool is None or pool.closed:
            pool = self._pools[owner] = OwnerPool(self._egress, self._max_connections)
        self._pools.move_to_end(owner)
        # The first lane with room, looked for inline: this runs for every call. Only when every lane
        # is full does the pool add one (docs/benchmarks.md, "An owner's calls over lanes").
        for lane in pool.lanes:
            if lane.in_flight < LANE_CALLS:
                break
        else:
            lane = pool.another_lane()
        pool.in_flight += 1
        lane.in_flight += 1
        return pool, lane

    def _release(self, pool: OwnerPool, lane: CurlPool) -> None:
        pool.in_flight -= 1
        lane.in_flight -= 1
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
            pool, lane = self._acquire(ctx.owner)
            try:
                return await self._send(lane, task, ctx, headers)
            finally:
                self._release(pool, lane)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            return Outcome.failure(f"timed out after {format_seconds(ctx.timeout_sec)}s")
        except CurlError as exc:
            return Outcome.failure(_call_error(exc, ctx.timeout_sec))
        except Exception as exc:  # bad URL, unserialisable body, ...: a failed run, not a worker crash
            return Outcome.failure(short_error(f"{type(exc).__name__}: {exc}"))

    async def _send(self, pool: CurlPool, task: dict[str, Any], ctx: TaskContext,
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
            target = outgoing_request(str(task["url"]))  # its host as libcurl will resolve it: the policy judges it
        except ValueError as exc:
            return Outcome.failure(short_error(f"cannot call {_shown(str(task['url']), exc)}: {exc}"))
        deadline = time.monotonic() + ctx.timeout_sec  # every hop, connect, send and body read together
        for _ in range(MAX_REDIRECTS + 1):
            refusal = self._host_refusal(target.host)
            if refusal is not None:  # a denied name is not even looked up
                return Outcome.failure(short_error(f"refused by egress policy: {refusal}"))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            tail = OutputTail(OUTPUT_TAIL_BYTES)
            reply = await pool.request(method, target.url, header_lines(headers), data, host=target.host,
                                       timeout_sec=remaining, on_body=tail.feed, typed="content-type" in headers)
            if reply.status not in _REDIRECT_STATUSES or not reply.redirect_url:
                return _outcome(reply, tail, task, ctx)
            if URL(reply.redirect_url).scheme not in ("http", "https"):
                return Outcome.failure(short_error(
                    f"HTTP {reply.status}: redirect to an unsupported URL {reply.redirect_url}"))
            try:
                following = outgoing_request(reply.redirect_url)
            except ValueError as exc:
                return Outcome.failure(short_error(
                    f"HTTP {reply.status}: redirect to {_shown(reply.redirect_url, exc)}: {exc}"))
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
