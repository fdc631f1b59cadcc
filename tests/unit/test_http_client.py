"""The HTTP tasks' client (chimes.worker.tasks.connections, under chimes.worker.tasks.http) against
real local servers: what it sends, what it reads back, how it keeps and drops connections, replies
that end early or are not HTTP, and TLS with the certificates Python trusts. No database."""

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

import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from chimes.security.ssrf import EgressPolicy
from chimes.worker.tasks.common import TaskContext
from chimes.worker.tasks.connections import ConnectionPool, Reply
from chimes.worker.tasks.http import HttpExecutor
from tests.helpers import wait_for


def ctx(timeout_sec: float = 10.0) -> TaskContext:
    return TaskContext("run-1", "job-1", 1, datetime(2026, 12, 1, tzinfo=UTC), timeout_sec)


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


async def test_many_calls_at_once_stay_within_max_connections_and_a_light_load_keeps_to_one(
    served: Served,
) -> None:
    executor = HttpExecutor(max_connections=8)
    try:
        outcomes = await asyncio.gather(*(executor.run({"type": "http", "url": f"{served.base}/n{i}"}, ctx())
                                          for i in range(40)))
        assert all(o.succeeded for o in outcomes)
        pool = executor.pool_of("")
        assert pool is not None and pool.in_flight == 0
        assert served.connections <= 8, "calls beyond max_connections wait for a connection"
        opened = served.connections
        for i in range(10):
            assert (await executor.run({"type": "http", "url": f"{served.base}/after{i}"}, ctx())).succeeded
        assert served.connections == opened, "one call at a time reuses a kept-alive connection"
    finally:
        await executor.close()
    assert pool.closed and pool.open_connections == 0


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


@pytest.mark.parametrize("path", ["zlib", "raw", "zlib?split", "raw?split"])
async def test_a_deflate_response_is_decoded_with_or_without_its_zlib_header(
    served: Served, http: HttpExecutor, path: str
) -> None:
    outcome = await http.run({"type": "http", "url": f"{served.base}/deflate/{path}"}, ctx())
    assert outcome.succeeded
    assert outcome.output == "inflated " * 10


async def test_the_output_is_decoded_in_the_charset_the_response_names(served: Served, http: HttpExecutor) -> None:
    assert (await http.run({"type": "http", "url": f"{served.base}/latin1"}, ctx())).output == "café"


async def test_an_endless_response_is_cut_at_the_read_limit_and_judged_by_its_status(
    served: Served, http: HttpExecutor
) -> None:
    outcome = await http.run({"type": "http", "url": f"{served.base}/endless"}, ctx(timeout_sec=30))
    assert outcome.succeeded and outcome.output is not None and set(outcome.output) == {"x"}
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
    assert pool is not None and pool.open_connections == 1
    await wait_for(lambda: pool.open_connections == 0, timeout=10, what="the closed idle connection to be let go")
    outcome = await asyncio.wait_for(http.run({"type": "http", "url": f"{short_keepalive}/second"}, ctx()), 10)
    assert outcome.output == "hello"
    assert pool.open_connections == 1, "the new connection is kept in its turn"


async def test_calls_taking_turns_between_two_targets_on_one_connection_all_arrive(
    served: Served, short_keepalive: str
) -> None:
    """With room for one connection, each call closes the other target's idle connection to open its
    own; calls at once wait for the one connection in turn."""
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
    assert outcome.error.startswith("the connection closed before the reply ended"), outcome.error
    assert len(raw_target.requests) == 1, "a request on a fresh connection is never written twice"


def _until_closed(connection: int, head: bytes) -> tuple[bytes, bool]:
    return b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it", True


def _cut_short(connection: int, head: bytes) -> tuple[bytes, bool]:
    return b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this", True


def _not_http(connection: int, head: bytes) -> tuple[bytes, bool]:
    return b"SSH-2.0-OpenSSH_9.6\r\n", False


def _large_head(connection: int, head: bytes) -> tuple[bytes, bool]:
    """An interim reply, then a final one whose head is large but within the bound."""
    return (b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nX-Large: " + b"a" * (200 * 1024) + b"\r\nContent-Length: 8\r\n\r\nthe body"), False


def _head_over_the_bound(connection: int, head: bytes) -> tuple[bytes, bool]:
    return b"HTTP/1.1 200 OK\r\nX-Endless: " + b"a" * (4 * 1024 * 1024) + b"\r\nContent-Length: 2\r\n\r\nok", False


@pytest.mark.parametrize(("raw_target", "succeeded", "said"), [
    (_until_closed, True, "all of it"),
    (_cut_short, False, "the connection closed before the reply ended"),
    (_not_http, False, "the target's reply is not valid HTTP"),
    (_large_head, True, "the body"),
    (_head_over_the_bound, False, "the target's reply head is over 300 KiB"),
], indirect=["raw_target"], ids=["body-to-the-close", "cut-short", "not-http", "large-head", "head-over-the-bound"])
async def test_a_reply_is_read_to_its_end_or_failed_saying_why(
    raw_target: RawTarget, http: HttpExecutor, succeeded: bool, said: str
) -> None:
    outcome = await asyncio.wait_for(http.run({"type": "http", "url": f"{raw_target.url}/r"}, ctx()), timeout=10)
    assert outcome.succeeded is succeeded
    assert said in ((outcome.output if succeeded else outcome.error) or ""), (outcome.output, outcome.error)


@pytest.mark.parametrize(("greeting", "said"), [
    (b"", "the connection closed before"),
    (b"SSH-2.0-OpenSSH_9.6\r\n", "the target's reply is not valid HTTP"),
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", "HTTP 400"),
], ids=["closes-at-once", "speaks-another-protocol", "answers-before-asked"])
async def test_a_target_that_speaks_or_closes_first_fails_the_call_at_once(
    http: HttpExecutor, greeting: bytes, said: str
) -> None:
    """A service that talks or hangs up as it accepts (an SSH or SMTP port named by mistake, a TCP
    wrapper refusing the peer): the run fails saying so, not at its timeout. The request is written
    before the loop reads what came (the call's task runs before the loop polls again), so what the
    target said is read as its reply."""
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


async def test_a_pool_carries_calls_on_kept_alive_connections_within_its_bound(served: Served) -> None:
    pool = ConnectionPool(EgressPolicy.build(), max_connections=4)
    port = int(served.base.rsplit(":", 1)[1])

    async def get(path: str) -> Reply:
        request = f"GET /{path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
        return await pool.perform(("http", "127.0.0.1", port), request, lambda chunk: True, time_limit())

    try:
        replies = await asyncio.wait_for(asyncio.gather(*(get(f"c{n}") for n in range(12))), timeout=10)
        replies.append(await asyncio.wait_for(get("last"), timeout=10))
        assert pool.open_connections == served.connections
    finally:
        pool.close()
    assert [r.status for r in replies] == [200] * 13
    assert len(served.requests) == 13 and served.connections <= 4
    assert pool.open_connections == 0


@pytest.mark.parametrize(("max_idle_sec", "connections"), [(60.0, 1), (0.0, 2)])
async def test_a_connection_idle_past_the_limit_is_closed_not_reused(
    served: Served, max_idle_sec: float, connections: int
) -> None:
    """Within the limit the second call reuses the first's connection; past it (here at once) the idle
    one is closed and a new one made, as a flow a firewall may have forgotten is never written on."""
    pool = ConnectionPool(EgressPolicy.build(), max_connections=4, max_idle_sec=max_idle_sec)
    port = int(served.base.rsplit(":", 1)[1])
    request = f"GET /again HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    try:
        for _ in range(2):
            reply = await pool.perform(("http", "127.0.0.1", port), request, lambda chunk: True, time_limit())
            assert reply.status == 200
        assert pool.open_connections == 1
    finally:
        pool.close()
    assert served.connections == connections and len(served.requests) == 2


def time_limit(seconds: float = 10.0) -> float:
    return time.monotonic() + seconds


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
    pool = ConnectionPool(EgressPolicy.build(), max_connections=2)
    request = f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            for _ in range(3):
                started = time.monotonic()
                with pytest.raises(TimeoutError):
                    await pool.perform(("http", "127.0.0.1", port), request, lambda chunk: True,
                                       time.monotonic() + 0.2)
                assert time.monotonic() - started < 5
            gc.collect()
        unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        assert unclosed == []
        assert pool.open_connections == 0
    finally:
        pool.close()
        for sock in [*queued, listener]:
            sock.close()


async def test_an_address_that_drops_packets_gets_a_share_of_the_time_and_the_next_one_answers(
    served: Served
) -> None:
    """A name with two addresses, the first dropping SYNs (a dead host behind round-robin DNS): the
    connect moves on to the second within the call's time, instead of spending all of it on the first."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    dead_port = listener.getsockname()[1]
    queued = [socket.create_connection(("127.0.0.1", dead_port), timeout=5)]  # fills the accept queue
    live_port = int(served.base.rsplit(":", 1)[1])

    def resolve(host: str, port: int) -> list[tuple[int, int, int, str, tuple[str, int]]]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", dead_port)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", live_port))]

    pool = ConnectionPool(EgressPolicy.build(), max_connections=2, resolve=resolve)
    request = b"GET /round-robin HTTP/1.1\r\nHost: service.test\r\n\r\n"
    try:
        reply = await pool.perform(("http", "service.test", 80), request, lambda chunk: True,
                                   time.monotonic() + 3.0)
    finally:
        pool.close()
        for sock in [*queued, listener]:
            sock.close()
    assert reply.status == 200
    assert [path for _, path, _, _ in served.requests] == ["/round-robin"]


async def test_a_closed_pool_refuses_new_calls_and_fails_those_in_flight(served: Served) -> None:
    pool = ConnectionPool(EgressPolicy.build(), max_connections=2)
    port = int(served.base.rsplit(":", 1)[1])
    origin = ("http", "127.0.0.1", port)
    request = f"GET /endless HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    call = asyncio.ensure_future(pool.perform(origin, request, lambda chunk: True, time_limit()))
    await wait_for(lambda: len(served.requests) == 1, timeout=10, what="the call to arrive")
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        await call
    with pytest.raises(RuntimeError, match="closed"):
        await pool.perform(origin, request, lambda chunk: True, time_limit())
