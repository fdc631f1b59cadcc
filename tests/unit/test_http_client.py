"""The HTTP tasks' client (libcurl: chimes.worker.tasks.curl, under chimes.worker.tasks.http) against
real local servers: what it sends, what it reads back, how it keeps and drops connections, replies
that end early or are not HTTP, TLS with the certificates Python trusts and its sessions shared,
HTTP/2, no proxy from the environment and no name lookup through Python's resolver. No database.
Targets that misbehave on purpose are in test_hostile_targets.py."""

from __future__ import annotations

import asyncio
import errno
import gc
import gzip
import ipaddress
import os
import select
import socket
import ssl
import time
import warnings
import zlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pycurl
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from chimes.security.ssrf import EgressPolicy
from chimes.worker.tasks.common import TaskContext
from chimes.worker.tasks.curl import CurlError, CurlPool, Reply, http2_available
from chimes.worker.tasks.http import LANE_CALLS, HttpExecutor
from tests.helpers import wait_for


def ctx(timeout_sec: float = 10.0, owner: str = "") -> TaskContext:
    return TaskContext("run-1", "job-1", 1, datetime(2026, 12, 1, tzinfo=UTC), timeout_sec, owner=owner)


class Served:
    """An aiohttp app on 127.0.0.1 that records the requests it got, and the connections they came on."""

    def __init__(self) -> None:
        self.peers: set[Any] = set()
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self.base = ""

    @property
    def connections(self) -> int:
        return len(self.peers)

    async def record(self, request: web.Request) -> None:
        assert request.transport is not None
        self.peers.add(request.transport.get_extra_info("peername"))
        self.requests.append((request.method, request.path, dict(request.headers), await request.read()))


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    state = Served()

    async def echo(request: web.Request) -> web.Response:
        await state.record(request)
        return web.Response(text=f"{request.method} {request.path}")

    async def compressed(request: web.Request) -> web.Response:
        await state.record(request)
        return web.Response(body=gzip.compress(b"unzipped " * 10), headers={"Content-Encoding": "gzip"})

    async def deflated(request: web.Request) -> web.StreamResponse:
        """``deflate`` as RFC 9110 says (a zlib stream) or as some servers send it (the raw data), its
        first byte alone in the first chunk when asked, to decide the framing across chunks."""
        await state.record(request)
        wbits = zlib.MAX_WBITS if request.match_info["framing"] == "zlib" else -zlib.MAX_WBITS
        compressor = zlib.compressobj(wbits=wbits)
        body = compressor.compress(b"inflated " * 10) + compressor.flush()
        response = web.StreamResponse(headers={"Content-Encoding": "deflate"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if "split" in request.query:
            await response.write(body[:1])
            body = body[1:]
        await response.write(body)
        await response.write_eof()
        return response

    async def latin1(request: web.Request) -> web.Response:
        await state.record(request)
        return web.Response(body="café".encode("latin-1"), content_type="text/plain", charset="iso-8859-1")

    async def endless(request: web.Request) -> web.StreamResponse:
        await state.record(request)
        response = web.StreamResponse(status=200)
        await response.prepare(request)
        while True:  # a stream that never ends: the client must stop reading it
            await response.write(b"x" * 8192)

    async def closing(request: web.Request) -> web.Response:
        await state.record(request)
        return web.Response(text="bye", headers={"Connection": "close"})

    app = web.Application()
    app.router.add_get("/gzip", compressed)
    app.router.add_get("/deflate/{framing}", deflated)
    app.router.add_get("/latin1", latin1)
    app.router.add_get("/endless", endless)
    app.router.add_get("/closing", closing)
    app.router.add_route("*", "/{tail:.*}", echo)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state.base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        yield state
    finally:
        await runner.cleanup()


async def test_calls_of_one_owner_share_kept_alive_connections(served: Served, http: HttpExecutor) -> None:
    outcomes = await asyncio.gather(*(http.run({"type": "http", "method": "POST", "url": f"{served.base}/n"}, ctx())
                                      for _ in range(40)))
    assert all(o.succeeded for o in outcomes)
    for _ in range(20):
        assert (await http.run({"type": "http", "url": f"{served.base}/n"}, ctx())).succeeded
    assert len(served.requests) == 60
    assert served.connections <= 10, "at most max_connections, then kept alive and reused"


async def test_many_calls_at_once_go_over_lanes_within_max_connections_and_a_light_load_keeps_to_one(
    served: Served,
) -> None:
    executor = HttpExecutor(max_connections=2 * LANE_CALLS)
    try:
        outcomes = await asyncio.gather(*(executor.run({"type": "http", "url": f"{served.base}/n{i}"}, ctx())
                                          for i in range(3 * LANE_CALLS)))
        assert all(o.succeeded for o in outcomes)
        pool = executor.pool_of("")
        assert pool is not None and len(pool.lanes) == 2, "a lane per LANE_CALLS at once, as max_connections allows"
        assert served.connections <= 2 * LANE_CALLS, "at most max_connections over all the lanes"
        assert pool.in_flight == 0 and [lane.in_flight for lane in pool.lanes] == [0, 0]
        opened = served.connections
        for i in range(10):
            assert (await executor.run({"type": "http", "url": f"{served.base}/after{i}"}, ctx())).succeeded
        assert served.connections == opened, "one call at a time takes the first lane's kept-alive connections"
        assert len(pool.lanes) == 2
    finally:
        await executor.close()
    assert pool.closed and all(lane.closed for lane in pool.lanes)


async def test_a_connection_the_target_closes_is_not_reused(served: Served, http: HttpExecutor) -> None:
    first = await http.run({"type": "http", "url": f"{served.base}/closing"}, ctx())
    second = await http.run({"type": "http", "url": f"{served.base}/n"}, ctx())
    assert (first.output, second.output) == ("bye", "GET /n")
    assert served.connections == 2


async def test_a_closed_executor_leaves_no_socket_open(served: Served) -> None:
    before = _open_descriptors()
    executor = HttpExecutor(max_connections=5)
    outcomes = await asyncio.gather(*(executor.run({"type": "http", "url": f"{served.base}/n"}, ctx())
                                      for _ in range(20)))
    assert all(o.succeeded for o in outcomes) and served.connections > 1
    assert _open_descriptors() > before
    await executor.close()
    # The target's ends close as they read the end of each connection.
    await wait_for(lambda: _open_descriptors() <= before, timeout=10, what="every connection to be closed")


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_every_method_is_sent_as_asked_with_or_without_a_body(served: Served, http: HttpExecutor) -> None:
    """One after the other, on one reused handle: each call's method and body, whatever the last call's
    were (a call like the last one, without a body, keeps the method the handle has)."""
    calls = [("DELETE", None), ("HEAD", None), ("PATCH", {"a": 1}), ("OPTIONS", None), ("GET", "q"), ("POST", None),
             ("PUT", None), ("PUT", None), ("GET", None), ("GET", None), ("HEAD", None), ("GET", None),
             ("POST", {"b": 2}), ("POST", None), ("POST", None), ("DELETE", None)]
    for method, body in calls:
        task = {"type": "http", "method": method, "url": f"{served.base}/m", **({"body": body} if body else {})}
        assert (await http.run(task, ctx())).succeeded, method
    sent = [(method, body, headers.get("Content-Length"), headers.get("Content-Type"))
            for method, _, headers, body in served.requests]
    assert sent == [("DELETE", b"", None, None), ("HEAD", b"", None, None),
                    ("PATCH", b'{"a":1}', "7", "application/json"), ("OPTIONS", b"", None, None),
                    ("GET", b"q", "1", "text/plain; charset=utf-8"), ("POST", b"", "0", None), ("PUT", b"", "0", None),
                    ("PUT", b"", "0", None), ("GET", b"", None, None), ("GET", b"", None, None),
                    ("HEAD", b"", None, None), ("GET", b"", None, None), ("POST", b'{"b":2}', "7", "application/json"),
                    ("POST", b"", "0", None), ("POST", b"", "0", None), ("DELETE", b"", None, None)]
    assert all("Expect" not in headers for _, _, headers, _ in served.requests)


async def test_an_empty_header_value_is_sent_empty(served: Served, http: HttpExecutor) -> None:
    assert (await http.run({"type": "http", "url": f"{served.base}/h", "headers": {"X-Empty": ""}}, ctx())).succeeded
    [(_, _, headers, _)] = served.requests
    assert headers["X-Empty"] == ""


async def test_a_compressed_response_is_kept_decoded(served: Served, http: HttpExecutor) -> None:
    outcome = await http.run({"type": "http", "url": f"{served.base}/gzip"}, ctx())
    assert outcome.output == "unzipped " * 10
    assert "gzip" in served.requests[0][2]["Accept-Encoding"]


@pytest.mark.parametrize("path", ["zlib", "raw", "zlib?split"])
async def test_a_deflate_response_is_decoded_with_or_without_its_zlib_header(
    served: Served, http: HttpExecutor, path: str
) -> None:
    outcome = await http.run({"type": "http", "url": f"{served.base}/deflate/{path}"}, ctx())
    assert outcome.succeeded
    assert outcome.output == "inflated " * 10


async def test_raw_deflate_whose_first_byte_comes_alone_fails_saying_it_cannot_be_decoded(
    served: Served, http: HttpExecutor
) -> None:
    """libcurl tells raw deflate from a zlib stream by the error its first bytes give; a first byte
    alone gives none, so such a reply is not read (docs/security.md): the run fails, saying why."""
    outcome = await http.run({"type": "http", "url": f"{served.base}/deflate/raw?split"}, ctx())
    assert not outcome.succeeded and outcome.error is not None
    assert outcome.error.startswith("the target's compressed body cannot be decoded"), outcome.error


async def test_the_output_is_decoded_in_the_charset_the_response_names(served: Served, http: HttpExecutor) -> None:
    assert (await http.run({"type": "http", "url": f"{served.base}/latin1"}, ctx())).output == "café"


async def test_an_endless_response_fails_at_the_bound_and_the_pool_carries_the_next_call(
    served: Served, http: HttpExecutor
) -> None:
    outcome = await http.run({"type": "http", "url": f"{served.base}/endless"}, ctx(timeout_sec=30))
    assert not outcome.succeeded and outcome.error is not None
    assert outcome.error.startswith("the target's reply body is over 16 MiB"), outcome.error
    pool = http.pool_of("")
    assert pool is not None and pool.in_flight == 0
    assert (await http.run({"type": "http", "url": f"{served.base}/after"}, ctx())).output == "GET /after"


@pytest.fixture
async def short_keepalive() -> AsyncIterator[str]:
    """A target that closes a connection idle for 0.2 s, as servers do after their keep-alive timeout."""

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_get("/{tail:.*}", hello)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=0.2, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


async def test_an_idle_connection_the_target_closes_is_let_go_and_the_next_call_connects_anew(
    short_keepalive: str, http: HttpExecutor
) -> None:
    assert (await http.run({"type": "http", "url": f"{short_keepalive}/first"}, ctx())).output == "hello"
    pool = http.pool_of("")
    assert pool is not None
    kept = pool.watched_sockets  # the kept-alive connection, and whatever libcurl watches of its own (an eventfd)
    assert kept >= 1
    # Its end of file comes while libcurl does not watch it: the pool lets it go (a socket left in the
    # set would wake the loop for ever), and libcurl finds the connection dead when it would reuse it.
    await wait_for(lambda: pool.watched_sockets == kept - 1, timeout=10, what="the closed idle connection to be let go")
    outcome = await asyncio.wait_for(http.run({"type": "http", "url": f"{short_keepalive}/second"}, ctx()), 10)
    assert outcome.output == "hello"
    assert pool.watched_sockets == kept, "the new connection is kept, and watched, in its turn"


async def test_calls_taking_turns_between_two_targets_on_one_connection_all_arrive(
    served: Served, short_keepalive: str
) -> None:
    """With room for one connection, each call closes the other target's idle connection, which
    libcurl no longer watched, and the next socket is often given its number: it must be watched
    afresh, not taken for the one parked there."""
    executor = HttpExecutor(max_connections=1)
    try:
        for n in range(30):
            url = f"{served.base}/n{n}" if n % 2 else f"{short_keepalive}/n{n}"
            outcome = await asyncio.wait_for(executor.run({"type": "http", "url": url}, ctx()), timeout=10)
            assert outcome.succeeded, (n, outcome.error)
        urls = [f"{served.base}/g{n}" if n % 2 else f"{short_keepalive}/g{n}" for n in range(20)]
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(executor.run({"type": "http", "url": url}, ctx()) for url in urls)), timeout=20)
    finally:
        await executor.close()
    assert all(o.succeeded for o in outcomes)
    assert len(served.requests) == 25  # 15 one after the other, then 10 at once


class RawTarget:
    """A listener on 127.0.0.1 that answers each connection's requests with the bytes a test scripts:
    ``script(connection, request)`` gives the reply to write, and whether to close the connection after."""

    def __init__(self, script: Any) -> None:
        self.script = script
        self.requests: list[tuple[int, bytes]] = []  # (the connection's number, the request's head)
        self.connections = 0
        self.url = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.requests.append((number, head))
                reply, close = self.script(number, head)
                writer.write(reply)
                await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def raw_target(request: pytest.FixtureRequest) -> AsyncIterator[RawTarget]:
    target = RawTarget(request.param)
    server = await asyncio.start_server(target.serve, "127.0.0.1", 0)
    target.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield target
    finally:
        server.close()


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def _second_request_dropped(connection: int, head: bytes) -> tuple[bytes, bool]:
    """The first connection answers one request, then closes on the next without a byte of reply:
    as a target whose keep-alive timeout ends just as a request is written."""
    if connection == 1 and head.startswith(b"POST /second"):
        return b"", True
    return OK, False


@pytest.mark.parametrize("raw_target", [_second_request_dropped], indirect=True)
async def test_a_request_a_kept_alive_connection_drops_unanswered_is_written_again_on_a_new_one(
    raw_target: RawTarget, http: HttpExecutor
) -> None:
    assert (await http.run({"type": "http", "method": "POST", "url": f"{raw_target.url}/first"}, ctx())).succeeded
    second = await http.run({"type": "http", "method": "POST", "url": f"{raw_target.url}/second"}, ctx())
    assert second.succeeded and second.output == "ok"
    assert [(n, head.split(b" ")[1]) for n, head in raw_target.requests] == [
        (1, b"/first"), (1, b"/second"), (2, b"/second")]


def _unsolicited_bytes_after_the_reply(connection: int, head: bytes) -> tuple[bytes, bool]:
    """The first connection follows its reply with the start of another no request asked for (a 408
    a server sends before closing an idle connection, caught half-written)."""
    if connection == 1:
        return OK + b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 50\r\n\r\npartial", False
    return OK, False


@pytest.mark.parametrize("raw_target", [_unsolicited_bytes_after_the_reply], indirect=True)
async def test_a_connection_that_sent_an_unasked_reply_is_not_reused(raw_target: RawTarget, http: HttpExecutor) -> None:
    first = await http.run({"type": "http", "url": f"{raw_target.url}/first"}, ctx(timeout_sec=5))
    second = await http.run({"type": "http", "url": f"{raw_target.url}/second"}, ctx(timeout_sec=5))
    assert (first.succeeded, first.output) == (True, "ok")
    assert (second.succeeded, second.output, second.error) == (True, "ok", None)
    assert [n for n, _ in raw_target.requests] == [1, 2]


def _closes_without_answering(connection: int, head: bytes) -> tuple[bytes, bool]:
    return b"", True


@pytest.mark.parametrize("raw_target", [_closes_without_answering], indirect=True)
async def test_a_new_connection_closed_without_a_reply_fails_the_call_once(
    raw_target: RawTarget, http: HttpExecutor
) -> None:
    outcome = await http.run({"type": "http", "method": "POST", "url": f"{raw_target.url}/x"}, ctx())
    assert not outcome.succeeded and outcome.error is not None
    assert outcome.error.startswith("the target closed the connection without a reply"), outcome.error
    assert len(raw_target.requests) == 1, "a request on a fresh connection is never written twice"


def _until_closed(connection: int, head: bytes) -> tuple[bytes, bool]:
    return b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it", True


def _cut_short(connection: int, head: bytes) -> tuple[bytes, bool]:
    return b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this", True


def _not_http(connection: int, head: bytes) -> tuple[bytes, bool]:
    return b"SSH-2.0-OpenSSH_9.6\r\n", False


def _large_head(connection: int, head: bytes) -> tuple[bytes, bool]:
    """An interim reply, then a final one whose head is large but within libcurl's bounds (100 KiB a
    line, 300 KiB in all)."""
    large = b"".join(b"X-Large-%d: %s\r\n" % (n, b"a" * (60 * 1024)) for n in range(4))
    return (b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n"
            b"HTTP/1.1 200 OK\r\n" + large + b"Content-Length: 8\r\n\r\nthe body"), False


def _head_over_the_bound(connection: int, head: bytes) -> tuple[bytes, bool]:
    return b"HTTP/1.1 200 OK\r\nX-Endless: " + b"a" * (4 * 1024 * 1024) + b"\r\nContent-Length: 2\r\n\r\nok", False


@pytest.mark.parametrize(("raw_target", "succeeded", "said"), [
    (_until_closed, True, "all of it"),
    (_cut_short, False, "the target closed the connection before its reply's body ended"),
    (_not_http, False, "the target's reply is not HTTP"),
    (_large_head, True, "the body"),
    (_head_over_the_bound, False, "the target's reply head is over libcurl's bound"),
], indirect=["raw_target"], ids=["body-to-the-close", "cut-short", "not-http", "large-head", "head-over-the-bound"])
async def test_a_reply_is_read_to_its_end_or_failed_saying_why(
    raw_target: RawTarget, http: HttpExecutor, succeeded: bool, said: str
) -> None:
    outcome = await asyncio.wait_for(http.run({"type": "http", "url": f"{raw_target.url}/r"}, ctx()), timeout=10)
    assert outcome.succeeded is succeeded
    assert said in ((outcome.output if succeeded else outcome.error) or ""), (outcome.output, outcome.error)


@pytest.mark.parametrize(("greeting", "said"), [
    (b"", "the target "),  # closed the connection without a reply, or reset it: as the request raced the close
    (b"SSH-2.0-OpenSSH_9.6\r\n", "the target's reply is not HTTP"),
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", "HTTP 400"),
], ids=["closes-at-once", "speaks-another-protocol", "answers-before-asked"])
async def test_a_target_that_speaks_or_closes_first_fails_the_call_at_once(
    http: HttpExecutor, greeting: bytes, said: str
) -> None:
    """A service that talks or hangs up as it accepts (an SSH or SMTP port named by mistake, a TCP
    wrapper refusing the peer): the run fails saying so, not at its timeout."""
    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(greeting)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(greet, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        outcome = await http.run({"type": "http", "url": f"http://127.0.0.1:{port}/x"}, ctx(timeout_sec=20))
    finally:
        server.close()
    assert not outcome.succeeded and outcome.error is not None
    assert said in outcome.error, outcome.error


async def test_a_header_name_that_is_not_a_token_fails_the_run_and_sends_nothing(
    served: Served, http: HttpExecutor
) -> None:
    """The API refuses such a name; a row written around it fails clearly, not with a smuggled line."""
    task = {"type": "http", "url": f"{served.base}/h", "headers": {"X-Ok\r\nX-Injected: 1": "v"}}
    outcome = await http.run(task, ctx())
    assert not outcome.succeeded and outcome.error is not None and "is not a token" in outcome.error
    assert served.requests == []


async def test_a_method_the_api_would_refuse_fails_the_run_and_sends_nothing(
    served: Served, http: HttpExecutor
) -> None:
    task = {"type": "http", "url": f"{served.base}/m", "method": "GET /other HTTP/1.1\r\nX-Injected: 1\r\n"}
    outcome = await http.run(task, ctx())
    assert not outcome.succeeded and outcome.error is not None
    assert outcome.error.startswith("method 'GET /OTHER HTTP/1.1"), outcome.error
    assert "is not one of DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT" in outcome.error
    assert served.requests == []


@pytest.mark.parametrize("own_epoll", [True, False], ids=["epoll-set", "loop-readers"])
async def test_a_pool_carries_calls_on_kept_alive_connections_within_its_bound_either_way_it_watches(
    served: Served, own_epoll: bool
) -> None:
    """The pool's own epoll set (Linux) and the loop's readers (elsewhere) carry the same calls."""
    pool = CurlPool(EgressPolicy.build(), max_connections=4, own_epoll=own_epoll)

    async def get(path: str) -> Reply:
        return await pool.request("GET", f"{served.base}/{path}", host="127.0.0.1", timeout_sec=10)

    try:
        replies = await asyncio.wait_for(asyncio.gather(*(get(f"c{n}") for n in range(12))), timeout=10)
        replies.append(await asyncio.wait_for(get("last"), timeout=10))
    finally:
        pool.close()
    assert [r.status for r in replies] == [200] * 13
    assert len(served.requests) == 13 and served.connections <= 4
    assert pool.watched_sockets == 0


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https-http1.1"])
async def test_calls_made_at_once_to_a_new_http1_target_run_at_once(
    tls: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three calls of 0.4 s each to an HTTP/1.1 target the pool has no connection to yet: all three are
    at the target together. (With libcurl's PIPEWAIT on a plain-HTTP target, the third waited for the
    first reply, as if the target could only take one connection at a time.)"""
    in_flight = most = 0
    context = None
    if tls:
        cert, key = _certificate(tmp_path)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))

    async def slow(request: web.Request) -> web.Response:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.4)
        in_flight -= 1
        return web.Response(text="done")

    app = web.Application()
    app.router.add_route("*", "/slow", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    url = f"{'https' if tls else 'http'}://127.0.0.1:{runner.addresses[0][1]}/slow"
    pool = CurlPool(EgressPolicy.build(), max_connections=8)
    try:
        replies = await asyncio.gather(*(pool.request("POST", url, host="127.0.0.1", timeout_sec=10)
                                         for _ in range(3)))
    finally:
        pool.close()
        await runner.cleanup()
    assert [r.status for r in replies] == [200] * 3
    assert most == 3


async def test_a_pools_request_sends_its_method_headers_and_body_and_hands_the_body_over(served: Served) -> None:
    """The pool alone, as another program would call a target with it: no Chimes headers but its own."""
    pool = CurlPool(EgressPolicy.build(), max_connections=2)
    pieces: list[bytes] = []
    try:
        reply = await pool.request("PUT", f"{served.base}/put", ["X-Mine: 1", "Content-Type: text/csv"], b"a,b",
                                   host="127.0.0.1", timeout_sec=10, on_body=pieces.append, typed=True)
    finally:
        pool.close()
    assert (reply.status, reply.content_type, reply.redirect_url) == (200, "text/plain; charset=utf-8", None)
    assert b"".join(pieces) == b"PUT /put" and reply.body_bytes == 8
    [(method, _, headers, body)] = served.requests
    assert (method, body, headers["X-Mine"], headers["Content-Type"]) == ("PUT", b"a,b", "1", "text/csv")
    assert "Expect" not in headers


@pytest.mark.parametrize(("max_idle_sec", "connections"), [(60, 1), (1, 2)])
async def test_a_connection_idle_past_the_limit_is_closed_not_reused(
    served: Served, max_idle_sec: int, connections: int
) -> None:
    """Within the limit the second call reuses the first's connection; past it (a second here, the
    least libcurl takes: 0 turns it off) the idle one is closed and a new one made, as a flow a firewall
    may have forgotten is never written on."""
    pool = CurlPool(EgressPolicy.build(), max_connections=4, max_idle_sec=max_idle_sec)
    try:
        first = await pool.request("GET", f"{served.base}/again", host="127.0.0.1", timeout_sec=10)
        await asyncio.sleep(1.2)  # the idle time itself is what is tested
        second = await pool.request("GET", f"{served.base}/again", host="127.0.0.1", timeout_sec=10)
    finally:
        pool.close()
    assert (first.status, second.status) == (200, 200)
    assert served.connections == connections and len(served.requests) == 2


def _certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "chimes test target")])
    now = datetime.now(UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - timedelta(minutes=1))
            .not_valid_after(now + timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "target.pem", folder / "target.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


async def test_https_trusts_the_certificates_python_trusts_and_no_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = _certificate(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="over tls")

    app = web.Application()
    app.router.add_get("/", hello)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    url = f"https://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/"  # type: ignore[union-attr]
    try:
        untrusting = HttpExecutor()
        refused = await untrusting.run({"type": "http", "url": url}, ctx())
        await untrusting.close()
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # how an operator adds a private CA (docs/security.md)
        trusting = HttpExecutor()
        accepted = await trusting.run({"type": "http", "url": url}, ctx())
        await trusting.close()
        # A fresh executor after one closed with TLS connections: nothing of the old ones is left.
        again = HttpExecutor()
        accepted_again = await asyncio.wait_for(again.run({"type": "http", "url": url}, ctx()), timeout=10)
        await again.close()
    finally:
        await runner.cleanup()
    assert refused.succeeded is False and refused.error is not None and "certificate" in refused.error.lower()
    assert accepted.succeeded and accepted.output == "over tls"
    assert accepted_again.succeeded and accepted_again.output == "over tls"


async def test_an_owners_new_pool_resumes_the_tls_session_another_owners_pool_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TLS sessions are shared by every pool (never connections): a pool made for another owner, or
    again after its owner's idled out, resumes the session instead of a full handshake."""
    cert, key = _certificate(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    resumed: list[tuple[str, bool]] = []

    async def hello(request: web.Request) -> web.Response:
        assert request.transport is not None
        resumed.append((request.path, request.transport.get_extra_info("ssl_object").session_reused))
        return web.Response(text="over tls")

    app = web.Application()
    app.router.add_get("/{owner}", hello)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    url = f"https://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    executor = HttpExecutor()
    try:
        for owner in ("team-a", "team-b"):
            outcome = await executor.run({"type": "http", "url": f"{url}/{owner}"}, ctx(owner=owner))
            assert outcome.succeeded, outcome.error
        first, second = executor.pool_of("team-a"), executor.pool_of("team-b")
        assert first is not None and second is not None and first.lanes[0] is not second.lanes[0]
    finally:
        await executor.close()
        await runner.cleanup()
    assert resumed == [("/team-a", False), ("/team-b", True)]


async def test_an_https_target_that_offers_http2_is_called_over_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real HTTP/2 server (hypercorn, which offers h2 and http/1.1 in TLS): libcurl takes HTTP/2, and
    once one connection is up, the calls of one owner at once share it."""
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    cert, key = _certificate(tmp_path)
    seen: list[tuple[str, Any]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        seen.append((scope["http_version"], scope["client"]))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": f"HTTP/{scope['http_version']}".encode()})

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(100)  # calls wait in its queue until the server accepts them
    port = listener.getsockname()[1]
    config = Config()
    config.bind = [f"fd://{listener.detach()}"]  # the server's to close
    config.certfile, config.keyfile = str(cert), str(key)
    config.accesslog = config.errorlog = None
    stop = asyncio.Event()
    server = asyncio.create_task(serve(app, config, shutdown_trigger=stop.wait))  # type: ignore[arg-type]
    url = f"https://127.0.0.1:{port}/"
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    executor = HttpExecutor()
    try:
        first = await asyncio.wait_for(executor.run({"type": "http", "url": url}, ctx()), timeout=20)
        outcomes = [first, *await asyncio.wait_for(
            asyncio.gather(*(executor.run({"type": "http", "url": url}, ctx()) for _ in range(5))), timeout=20)]
    finally:
        await executor.close()
        stop.set()
        await server
    assert [o.output for o in outcomes] == ["HTTP/2"] * 6, outcomes
    assert [version for version, _ in seen] == ["2"] * 6
    assert len({client for _, client in seen}) == 1, "one connection carries the calls at once"


async def test_a_connect_that_never_completes_times_out_and_closes_its_socket() -> None:
    """A target that drops SYNs (here: a listener whose accept queue is full, which Linux answers by
    dropping them) holds the connect until the call's deadline; the socket is then closed at once,
    not left for the garbage collector to find."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    queued = [socket.create_connection(("127.0.0.1", port), timeout=5)]  # fills the accept queue
    probe = socket.socket()
    probe.setblocking(False)
    queued.append(probe)
    assert probe.connect_ex(("127.0.0.1", port)) == errno.EINPROGRESS
    assert select.select([], [probe], [], 0.3)[1] == [], "a connect to the full listener completed"
    pool = CurlPool(EgressPolicy.build(), max_connections=2)
    before = _open_descriptors()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            for _ in range(3):
                started = time.monotonic()
                with pytest.raises(CurlError) as timed_out:
                    await pool.request("GET", f"http://127.0.0.1:{port}/", host="127.0.0.1", timeout_sec=0.2)
                assert timed_out.value.code == pycurl.E_OPERATION_TIMEDOUT
                assert time.monotonic() - started < 5
            gc.collect()
        unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        assert unclosed == []
        assert _open_descriptors() <= before
    finally:
        pool.close()
        for sock in [*queued, listener]:
            sock.close()


async def test_an_address_that_drops_packets_gets_a_share_of_the_time_and_the_next_one_answers(
    served: Served
) -> None:
    """A name with two addresses, the first dropping SYNs (a dead host behind round-robin DNS): libcurl
    moves on to the second within the call's time, instead of spending all of it on the first."""
    live_port = int(served.base.rsplit(":", 1)[1])
    listener = socket.socket()
    listener.bind(("127.0.0.2", live_port))  # the same port on another address, dropping SYNs
    listener.listen(0)
    queued = [socket.create_connection(("127.0.0.2", live_port), timeout=5)]  # fills the accept queue
    pool = CurlPool(EgressPolicy.build(), max_connections=2)
    transfer = pool.transfer("service.test", None)
    transfer.curl.setopt(pycurl.URL, f"http://service.test:{live_port}/round-robin")
    transfer.curl.setopt(pycurl.RESOLVE, [f"service.test:{live_port}:127.0.0.2,127.0.0.1"])
    transfer.curl.setopt(pycurl.TIMEOUT_MS, 3000)
    try:
        reply = await pool.perform(transfer)
    finally:
        pool.close()
        for sock in [*queued, listener]:
            sock.close()
    assert reply.status == 200
    assert [path for _, path, _, _ in served.requests] == ["/round-robin"]


async def test_a_closed_pool_refuses_new_calls_and_fails_those_in_flight() -> None:
    asked, hung_up = asyncio.Event(), asyncio.Event()

    async def never_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        asked.set()
        await reader.read()  # until the client closes
        writer.close()
        hung_up.set()

    server = await asyncio.start_server(never_answers, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/held"
    pool = CurlPool(EgressPolicy.build(), max_connections=2)
    try:
        call = asyncio.ensure_future(pool.request("GET", url, host="127.0.0.1", timeout_sec=10))
        await asyncio.wait_for(asked.wait(), timeout=10)
        pool.close()
        with pytest.raises(RuntimeError, match="closed"):
            await call
        with pytest.raises(RuntimeError, match="closed"):
            await pool.request("GET", url, host="127.0.0.1", timeout_sec=10)
        await asyncio.wait_for(hung_up.wait(), timeout=10)
    finally:
        server.close()


async def test_no_proxy_from_the_environment_is_used(
    served: Served, http: HttpExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The egress check is on the target: a proxy named by the environment would receive the call
    (and make it from wherever it stands) instead."""
    proxied: list[bytes] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        proxied.append(await reader.read(1024))
        writer.close()

    server = await asyncio.start_server(proxy, "127.0.0.1", 0)
    proxy_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, proxy_url)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    try:
        outcome = await http.run({"type": "http", "url": f"{served.base}/direct"}, ctx())
    finally:
        server.close()
    assert outcome.succeeded and outcome.output == "GET /direct"
    assert proxied == []


async def test_names_are_looked_up_by_libcurl_not_through_pythons_resolver(
    served: Served, http: HttpExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """libcurl looks names up on threads of its own: not on the event loop's shared executor, where a
    DNS server that drops queries would hold every thread, and every owner's new connections."""
    def no_lookup(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"looked up through Python: {args}")

    monkeypatch.setattr(socket, "getaddrinfo", no_lookup)
    port = served.base.rsplit(":", 1)[1]
    outcome = await http.run({"type": "http", "url": f"http://localhost:{port}/by-name"}, ctx())
    assert outcome.succeeded and outcome.output == "GET /by-name", outcome.error


def test_the_pycurl_wheel_speaks_http2() -> None:
    """docs/security.md says HTTPS targets are offered HTTP/2: the libcurl installed must have it."""
    assert http2_available(), pycurl.version
