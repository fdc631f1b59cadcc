"""HTTP/1.1 over kept-alive connections, on the running asyncio loop: the client of HTTP tasks.

A :class:`ConnectionPool` holds one owner's connections, by origin (scheme, host and port). A call
takes an idle connection of its origin, or opens one, writes the request in one ``write`` and reads
the reply through httptools' C parser (llhttp, Node's): the loop's protocol callbacks and the
parser's are all a call costs besides the request's own Python. A worker spends 22% fewer
instructions a run than through libcurl's socket and timer callbacks and its request formatting
(docs/benchmarks.md, "HTTP tasks over the loop's own connections").

Every connection is opened to an address the pool resolved itself and the egress policy judged,
that very address: no lookup can be swapped in between (DNS rebinding). No proxy is ever used.
HTTPS is verified against the certificates Python's ``ssl`` module trusts (``SSL_CERT_FILE`` and
``SSL_CERT_DIR`` included).

A kept-alive connection the target closed while it was idle can fail the next request written on it
before any byte of a reply comes back: that request is written again on a new connection, once, as
browsers and libcurl do. A target that read it and closed without answering may so see it twice;
its ``Idempotency-Key`` header (the run id) is what tells it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import ssl
import time
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import httptools

from chimes.security.ssrf import EgressPolicy

__all__ = ["CallError", "ConnectionPool", "Reply"]

OnBody = Callable[[bytes], bool]  # (a chunk of the decoded body) -> whether to read on
#: The most a compressed chunk is decoded to at once: a caller reads a bounded body (a run's output
#: tail), and a small chunk can decode to gigabytes.
MAX_DECODED_CHUNK = 256 * 1024
#: The most bytes a reply's head (status line and headers, interim replies included) may take, as
#: libcurl's bound: the parser gathers a header in memory until its end, so a target sending one
#: endless header would grow the worker's memory and spend its loop copying.
MAX_REPLY_HEAD = 300 * 1024
#: A connection idle longer is closed rather than reused, as libcurl's default (CURLOPT_MAXAGE_CONN):
#: a firewall or NAT that forgets an idle flow drops its packets without a word, and a request
#: written on it would wait for a reply until the run's timeout.
MAX_IDLE_SEC = 118.0


class Reply(NamedTuple):
    """What a call's caller reads of the response besides its body (which went to ``on_body``)."""

    status: int
    content_type: str | None
    location: str | None  # the Location header as sent: relative or absolute


class CallError(Exception):
    """A call that failed below HTTP: no connection, a broken one, a reply that is not HTTP.
    ``refusals``: why the egress policy refused the addresses it would not connect to;
    ``os_errno``: the system's error behind it (ECONNREFUSED, ...)."""

    def __init__(self, message: str, *, refusals: tuple[str, ...] = (), os_errno: int = 0) -> None:
        super().__init__(message)
        self.refusals = refusals
        self.os_errno = os_errno


class _Stale(Exception):
    """A reused connection ended before any byte of the reply: the request is written again."""


_Origin = tuple[str, str, int]  # scheme, host, port
_Answers = Sequence[tuple[int, int, int, str, tuple[Any, ...]]]  # getaddrinfo's


class _Connection(asyncio.Protocol):
    """One connection and the call it carries, if any; the parser's callbacks are its methods."""

    def __init__(self, pool: ConnectionPool, origin: _Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.future: asyncio.Future[Reply] | None = None
        self.on_body_chunk: OnBody | None = None
        self.head = False  # the call is a HEAD: its reply has no body, whatever its headers say
        self.reused = False
        self.idle_since = 0.0  # monotonic: when it was last put back idle
        self.received = False  # a byte of the current reply came
        self.reusable = False  # the current reply ended cleanly, and the target keeps the connection
        self.closed = False
        self.content_type: str | None = None
        self.location: str | None = None
        self.length_known = False  # Content-Length or chunked: a close before its end is an error
        self.reading_head = False  # the current reply's head has not ended yet
        self.head_bytes = 0  # the bytes received while it had not
        self.decoder: zlib._Decompress | None = None
        self.deflate_head: bytes | None = None  # a deflate body's first bytes, until they show its framing

    def start(self, future: asyncio.Future[Reply], on_body: OnBody, head: bool) -> None:
        self.future = future
        self.on_body_chunk = on_body
        self.head = head
        self.received = self.reusable = self.length_known = False
        self.reading_head = True
        self.head_bytes = 0
        self.content_type = self.location = None
        self.decoder = None
        self.deflate_head = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(CallError(f"the target's reply is not valid HTTP: {exc}"))
            return
        except httptools.HttpParserUpgrade:
            self._fail(CallError("the target switched protocols"))
            return
        if self.reading_head:  # these bytes did not end the head
            self.head_bytes += len(data)
            if self.head_bytes > MAX_REPLY_HEAD:
                self._fail(CallError(f"the target's reply head is over {MAX_REPLY_HEAD // 1024} KiB"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        future = self.future
        if future is None or future.done():
            return
        if not self.received and self.reused:
            future.set_exception(_Stale())
        elif self.received and self.parser.get_status_code() and not self.length_known:
            self._end()  # a body that runs to the connection's end, as HTTP/1.0 sends it
        else:
            reason = f": {exc}" if exc else ""
            future.set_exception(CallError(f"the connection closed before the reply ended{reason}",
                                           os_errno=getattr(exc, "errno", 0) or 0))

    # httptools.HttpResponseParser's callbacks

    def on_message_begin(self) -> None:
        if self.future is None or self.future.done():  # a reply no request asked for (an idle
            self._fail(CallError("the target sent a reply no request asked for"))  # 408, say): closed

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type":
            self.content_type = value.decode("latin-1")
        elif name == b"location":
            self.location = value.decode("latin-1")
        elif name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self.length_known = True
        elif name == b"content-encoding":
            encoding = value.strip().lower()
            if encoding in (b"gzip", b"x-gzip"):
                self.decoder = zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib, by the header's bytes
            elif encoding == b"deflate":
                self.deflate_head = b""

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if not 100 <= status < 200:  # an interim reply's head counts towards the final one's
            self.reading_head = False
        if self.head or status in (204, 304):
            self.length_known = True
            if self.head:  # no body follows, whatever Content-Length says: httptools cannot be told
                self._end(keep=False)

    def on_body(self, body: bytes) -> None:
        if self.future is None or self.future.done():
            return
        if self.deflate_head is not None:
            body = self.deflate_head + body
            if len(body) < 2:
                self.deflate_head = body
                return
            self.deflate_head = None
            self.decoder = _deflate_decoder(body)
        if self.decoder is not None:
            try:
                body = self.decoder.decompress(body, MAX_DECODED_CHUNK)
            except zlib.error as exc:
                self._fail(CallError(f"the target's compressed body cannot be read: {exc}"))
                return
        if not self.on_body_chunk or not self.on_body_chunk(body):  # read enough: the rest is not waited for
            self._end(keep=False)

    def on_message_complete(self) -> None:
        if 100 <= self.parser.get_status_code() < 200:  # an interim reply (103 Early Hints): the reply follows
            return
        self._end(keep=self.parser.should_keep_alive())

    def _end(self, keep: bool = False) -> None:
        future = self.future
        if future is None or future.done():
            return
        self.reusable = keep
        future.set_result(Reply(self.parser.get_status_code(), self.content_type, self.location))

    def _fail(self, error: CallError) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_exception(error)
        self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            if self.transport is not None:
                self.transport.close()


def _deflate_decoder(first_bytes: bytes) -> zlib._Decompress:
    """HTTP's deflate is a zlib stream (RFC 9110), but some servers send the raw deflate data without
    its zlib header; browsers and libcurl read both, told apart by whether the first two bytes are a
    valid zlib header (compression method 8, a check value divisible by 31)."""
    zlib_header = first_bytes[0] & 0x0F == 8 and (first_bytes[0] << 8 | first_bytes[1]) % 31 == 0
    return zlib.decompressobj(zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS)


class ConnectionPool:
    """One owner's connections, at most ``max_connections`` open together; a call beyond them waits
    for one to be free. Bound to the running loop."""

    def __init__(self, policy: EgressPolicy, *, max_connections: int, max_idle_sec: float = MAX_IDLE_SEC,
                 resolve: Callable[[str, int], _Answers] | None = None) -> None:
        """``resolve``: the lookup, ``loop.getaddrinfo``'s answers for (host, port), replaceable in tests
        that stand in for a DNS server."""
        self._loop = asyncio.get_running_loop()
        self._policy = policy
        self._max = max_connections
        self._max_idle_sec = max_idle_sec
        self._resolve = resolve
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._opening = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._tls: ssl.SSLContext | None = None
        self.closed = False

    @property
    def open_connections(self) -> int:
        return len(self._open)

    async def perform(self, origin: _Origin, request: bytes, on_body: OnBody, deadline: float,
                      *, head: bool = False) -> Reply:
        """Write ``request`` (its head and body, framed) to ``origin`` and read the reply; its body goes
        to ``on_body`` until that returns False. ``deadline``: monotonic, for the whole call, the
        connection included. Raises :class:`CallError` below HTTP, TimeoutError past the deadline."""
        if self.closed:
            raise RuntimeError("the connection pool is closed")
        task = asyncio.current_task()
        assert task is not None
        expired: list[bool] = []
        # One timer a call, which cancels the call's task: cheaper than asyncio.timeout's context.
        timer = self._loop.call_later(max(0.0, deadline - time.monotonic()), _time_out, task, expired)
        try:
            try:
                return await self._call(origin, request, on_body, deadline, head, reuse=True)
            except _Stale:
                return await self._call(origin, request, on_body, deadline, head, reuse=False)
        except asyncio.CancelledError:
            if expired and task.uncancel() == 0:
                raise TimeoutError from None
            raise
        finally:
            timer.cancel()

    async def _call(self, origin: _Origin, request: bytes, on_body: OnBody, deadline: float, head: bool,
                    *, reuse: bool) -> Reply:
        conn = self._take_idle(origin) if reuse else None
        if conn is None:
            conn = await self._connect(origin, deadline)
        else:
            conn.reused = True
        future: asyncio.Future[Reply] = self._loop.create_future()
        conn.start(future, on_body, head)
        assert conn.transport is not None
        conn.transport.write(request)
        try:
            reply = await future
        except BaseException:
            conn.close()
            raise
        finally:
            conn.future = conn.on_body_chunk = None
        if conn.reusable and not conn.closed and not self.closed:
            conn.idle_since = time.monotonic()
            self._idle.setdefault(origin, []).append(conn)
            self._free_one()
        else:
            conn.close()
        return reply

    def _take_idle(self, origin: _Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()  # the most recently used: any older one is older still
            if (not conn.closed and conn.transport is not None and not conn.transport.is_closing()
                    and time.monotonic() - conn.idle_since < self._max_idle_sec):
                return conn
            conn.close()
        return None

    async def _connect(self, origin: _Origin, deadline: float) -> _Connection:
        while len(self._open) + self._opening >= self._max:
            if not self._close_an_idle_one():
                waiter = self._loop.create_future()
                self._waiting.append(waiter)
                try:
                    await waiter
                finally:
                    with contextlib.suppress(ValueError):
                        self._waiting.remove(waiter)
                reused = self._take_idle(origin)
                if reused is not None:
                    reused.reused = True
                    return reused
        self._opening += 1
        try:
            conn = await self._open_connection(origin, deadline)
        finally:
            self._opening -= 1
        self._open.add(conn)
        return conn

    async def _open_connection(self, origin: _Origin, deadline: float) -> _Connection:
        scheme, host, port = origin
        answers: _Answers
        if self._resolve is not None:
            answers = self._resolve(host, port)
        else:
            try:
                answers = await self._loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except socket.gaierror as exc:
                raise CallError(f"Could not resolve host: {host} ({exc.strerror})") from None
        refusals: list[str] = []
        allowed = []
        for answer in answers:
            refusal = self._policy.refusal(host, str(answer[4][0]))
            if refusal is None:
                allowed.append(answer)
            else:
                refusals.append(refusal)
        failure: OSError | None = None
        for index, (family, kind, protocol, _name, address) in enumerate(allowed):
            sock = socket.socket(family, kind, protocol)
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                # Each address but the last gets its share of the time left, as libcurl gives it: one
                # that drops packets must not spend the whole call. The last has the call's deadline.
                untried = len(allowed) - index
                share = (deadline - time.monotonic()) / untried if untried > 1 else None
                try:
                    async with asyncio.timeout(share):
                        await self._loop.sock_connect(sock, address)
                except TimeoutError:
                    raise OSError(errno.ETIMEDOUT, os.strerror(errno.ETIMEDOUT)) from None
                tls = self._tls_context() if scheme == "https" else None
                _, conn = await self._loop.create_connection(
                    lambda: _Connection(self, origin), sock=sock, ssl=tls, server_hostname=host if tls else None,
                    ssl_handshake_timeout=max(0.001, deadline - time.monotonic()) if tls else None)
                return conn
            except ssl.SSLCertVerificationError as exc:
                sock.close()
                raise CallError(f"TLS with {host}:{port} failed: certificate verify failed: "
                                f"{exc.verify_message}") from None
            except ssl.SSLError as exc:
                sock.close()
                raise CallError(f"TLS with {host}:{port} failed: {exc.reason or exc}") from None
            except OSError as exc:
                sock.close()
                failure = exc
            except BaseException:  # the call timed out or was cancelled while connecting
                sock.close()
                raise
        if failure is not None:
            raise CallError(f"Failed to connect to {host}:{port}: {failure.strerror or failure}",
                            refusals=tuple(refusals), os_errno=failure.errno or 0)
        raise CallError(f"Failed to connect to {host}:{port}: no address allowed", refusals=tuple(refusals),
                        os_errno=errno.EACCES)

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            # The certificates Python's own ssl module trusts, SSL_CERT_FILE and SSL_CERT_DIR included.
            self._tls = ssl.create_default_context()
            self._tls.set_alpn_protocols(["http/1.1"])
        return self._tls

    def _close_an_idle_one(self) -> bool:
        """Close the longest idle connection of any origin to make room for one; False if none is idle."""
        for idle in self._idle.values():
            if idle:
                idle.pop(0).close()
                return True
        return False

    def _forget(self, conn: _Connection) -> None:
        if conn in self._open:
            self._open.discard(conn)
            idle = self._idle.get(conn.origin)
            if idle and conn in idle:
                idle.remove(conn)
            self._free_one()

    def _free_one(self) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        """Close every connection; calls still in flight fail."""
        if self.closed:
            return
        self.closed = True
        for conn in list(self._open):
            if conn.future is not None and not conn.future.done():
                conn.future.set_exception(RuntimeError("the connection pool was closed"))
            conn.close()
        self._idle.clear()
        for waiter in self._waiting:
            if not waiter.done():
                waiter.set_exception(RuntimeError("the connection pool was closed"))


def _time_out(task: asyncio.Task[object], expired: list[bool]) -> None:
    expired.append(True)
    task.cancel()
