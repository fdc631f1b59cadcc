"""libcurl's multi interface, driven by the running asyncio loop: the client of HTTP tasks.

A :class:`CurlPool` is one ``pycurl.CurlMulti``, that is one cache of kept-alive connections, and the
easy handles that go through it; :meth:`CurlPool.request` makes one call. libcurl does the HTTP
(framing, keep-alive, TLS, HTTP/2 to HTTPS targets, Happy Eyeballs, name lookups on its own threads,
decoding): its bounds are the worker's, since every tenant picks its own target (a reply's head at
300 KiB, a header or trailer line at 100 KiB and 4 KiB, 5,000 of them; a decoder stops at its
stream's end and fails on bytes after it). This module adds one bound, on the bytes a reply's body
delivers, raw and decoded (:data:`MAX_REPLY_BYTES`), and keeps nothing of a body but what the caller
keeps (``on_body``).

Every connection is opened through :meth:`Transfer._open_socket` (``CURLOPT_OPENSOCKETFUNCTION``),
which libcurl calls with the address it is about to connect to, after its name lookup: the egress
policy judges that very address, so no lookup can be swapped in between (DNS rebinding). libcurl
forbids calling back into it from its callbacks; the socket and timer callbacks here only register
with the loop, and the loop's callbacks call ``socket_action``.

Two things libcurl reports are not taken as it reports them (:meth:`Transfer._header`, which only
notes which of the lines libcurl hands over belong to the final head): a head that the target's close
cut short passes as a whole reply, and ``CURLINFO_CONTENT_TYPE`` and ``CURLINFO_REDIRECT_URL`` keep
an interim (1xx) reply's values when the final head has none.

Name lookups and TLS sessions are shared by every pool (one ``CurlShare``): an owner's new pool
resumes the sessions others made with the same target. Connections never are: each pool is one
owner's (chimes.worker.tasks.http).

On Linux a pool watches its connections' sockets in an epoll set of its own, and the loop watches
that one descriptor (:class:`_EpollWatch`). Through the loop's own readers every call cost a poll
handle made and freed and about six ``epoll_ctl`` calls, half of them failing, as libcurl stops
watching a kept-alive connection when a call ends and watches it again when the next call reuses it
(docs/benchmarks.md). Here the idle connection stays in the set ("parked"): reusing it is one
``epoll_ctl``, and a closed one leaves the set by itself, which the kernel does when the last
descriptor of a socket is closed, whether or not libcurl said so. Elsewhere the loop's readers and
writers watch each socket (:class:`_LoopWatch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import select
import socket
import ssl
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import pycurl

from chimes.security.ssrf import EgressPolicy

__all__ = ["MAX_IDLE_SEC", "MAX_REPLY_BYTES", "CurlError", "CurlPool", "Reply", "Transfer", "http2_available"]

#: Most bytes a reply's body may deliver, counted on the wire and again decoded: past it the call
#: fails. A decompression bomb or an endless body must not hold a worker's slot and CPU to the timeout.
MAX_REPLY_BYTES = 16 * 1024 * 1024
#: A kept-alive connection idle this long is closed rather than reused (libcurl's default age): a flow
#: that a firewall or NAT forgot would hold the request until the call's timeout.
MAX_IDLE_SEC = 118

_IN, _OUT = 1, 2  # pycurl.POLL_IN and POLL_OUT as bits: POLL_INOUT is both
_ONLY_HTTP = pycurl.PROTO_HTTP | pycurl.PROTO_HTTPS
# CURLE_* codes that pycurl has no name for (or only an FTP one): libcurl's numbers are stable.
_E_WEIRD_SERVER_REPLY, _E_HTTP2_STREAM, _E_TOO_LARGE = 8, 92, 100


class CurlError(Exception):
    """A call that libcurl ended with an error: ``code`` is its CURLE_* number, ``os_errno`` the
    system's error behind it (ECONNREFUSED, ...), ``refusals`` why the egress policy refused the
    addresses it would not connect to. ``str()`` says what the target did, then libcurl's words."""

    def __init__(self, code: int, message: str, os_errno: int = 0, refusals: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.os_errno = os_errno
        self.refusals = refusals


class Reply(NamedTuple):
    """What a call's caller reads of the reply besides its body (which went to ``on_body``). A named
    tuple: one is made per call."""

    status: int
    content_type: str | None  # the final head's, never an interim reply's
    redirect_url: str | None  # the final head's Location, as an absolute URL resolved by libcurl
    body_bytes: int  # the body's bytes as delivered, decoded


def http2_available() -> bool:
    """Whether this libcurl speaks HTTP/2 (nghttp2): HTTPS targets are then offered it in TLS."""
    return bool(pycurl.version_info()[4] & pycurl.VERSION_HTTP2)


_SHARE: pycurl.CurlShare | None = None


def _share() -> pycurl.CurlShare:
    """The name lookups and TLS sessions every pool shares, made on first use. Never connections."""
    global _SHARE
    if _SHARE is None:
        share = pycurl.CurlShare()
        share.setopt(pycurl.SH_SHARE, pycurl.LOCK_DATA_DNS)
        share.setopt(pycurl.SH_SHARE, pycurl.LOCK_DATA_SSL_SESSION)
        _SHARE = share
    return _SHARE


def _certificates() -> tuple[str | None, str | None]:
    """The CA file and folder for libcurl: those Python's own ssl module trusts (SSL_CERT_FILE and
    SSL_CERT_DIR included), not the paths the library was built with, which another distribution may
    not have. The folder only when there is no file or SSL_CERT_DIR names it: libcurl keeps a loaded
    store for a multi handle's later connections only when it comes from a file alone."""
    verify = ssl.get_default_verify_paths()
    folder = verify.capath if verify.cafile is None or os.environ.get(verify.openssl_capath_env) else None
    return verify.cafile, folder


class Transfer:
    """One easy handle, reused call after call, and what the current call collects: the body's bytes
    (through ``on_body``), the egress refusals of the addresses it would not connect to, and what the
    header callback noted of the final head."""

    __slots__ = ("_max_bytes", "_opened", "_policy", "content_type_named", "curl", "delivered", "future",
                 "head_ended", "host", "location_named", "method", "on_body", "over", "refusals")

    def __init__(self, policy: EgressPolicy, opened: list[socket.socket], certificates: tuple[str | None, str | None],
                 max_bytes: int, max_idle_sec: int) -> None:
        self._policy = policy
        self._opened = opened  # sockets whose descriptor pycurl has duplicated: the pool closes ours
        self._max_bytes = max_bytes
        self.curl = pycurl.Curl()
        self.future: asyncio.Future[None] | None = None
        self.host = ""
        self.method = ""  # the method set on the handle, when without a body: the next such call's is already set
        self.on_body: Callable[[bytes], object] | None = None
        self.refusals: list[str] = []
        self.delivered = 0
        self.over = False
        self.head_ended = self.content_type_named = self.location_named = False
        curl = self.curl
        curl.setopt(pycurl.NOSIGNAL, 1)  # no SIGALRM or SIGPIPE games inside an event loop
        # Never a proxy from the environment (http_proxy, https_proxy, ALL_PROXY): the egress check is
        # on the target itself.
        curl.setopt(pycurl.PROXY, "")
        curl.setopt(pycurl.NOPROXY, "*")
        curl.setopt(pycurl.PROTOCOLS, _ONLY_HTTP)
        curl.setopt(pycurl.REDIR_PROTOCOLS, _ONLY_HTTP)  # redirects are followed by the caller, hop by hop
        curl.setopt(pycurl.SHARE, _share())
        curl.setopt(pycurl.OPENSOCKETFUNCTION, self._open_socket)
        curl.setopt(pycurl.WRITEFUNCTION, self._write)
        curl.setopt(pycurl.HEADERFUNCTION, self._header)
        curl.setopt(pycurl.ACCEPT_ENCODING, "gzip, deflate")  # decoded before on_body sees it
        curl.setopt(pycurl.MAXFILESIZE_LARGE, max_bytes)  # the body's bytes on the wire, before decoding
        curl.setopt(pycurl.MAXAGE_CONN, max_idle_sec)
        # HTTP/2 to HTTPS targets that offer it in TLS, HTTP/1.1 to the rest. Not PIPEWAIT: libcurl would
        # hold a call back until another connection to the target had its first reply, to see whether
        # the call could share it, however long that reply takes: to an HTTP/1.1 target, calls made at
        # once went one after another. Calls that start together open connections of their own; the
        # calls after them share an HTTP/2 one.
        curl.setopt(pycurl.HTTP_VERSION, pycurl.CURL_HTTP_VERSION_2TLS)
        cafile, capath = certificates
        if cafile:
            curl.setopt(pycurl.CAINFO, cafile)
        if capath:
            curl.setopt(pycurl.CAPATH, capath)

    def start(self, host: str, on_body: Callable[[bytes], object] | None) -> None:
        self.host = host
        self.on_body = on_body
        self.refusals.clear()
        self.delivered = 0
        self.over = self.head_ended = self.content_type_named = self.location_named = False

    def _open_socket(self, _purpose: int, address: tuple[int, int, int, tuple[Any, ...]]) -> Any:
        family, socktype, protocol, peer = address
        reason = self._policy.refusal(self.host, str(peer[0]))
        if reason is not None:  # libcurl tries the host's next address, if it has one
            self.refusals.append(reason)
            return pycurl.SOCKET_BAD
        sock = socket.socket(family, socktype, protocol)
        self._opened.append(sock)  # pycurl keeps a duplicate of its descriptor
        return sock

    def _write(self, chunk: bytes) -> int | None:
        self.delivered += len(chunk)
        if self.delivered > self._max_bytes:
            self.over = True
            return 0  # anything but len(chunk): libcurl ends the transfer with CURLE_WRITE_ERROR
        if self.on_body is not None:
            self.on_body(chunk)
        return None

    def _header(self, line: bytes) -> None:
        """Each line of each head libcurl read, as it hands them over (and trailers after the body):
        which belong to the final head, and whether it ended with its empty line."""
        if line[:5] == b"HTTP/":  # a status line: a new head, an interim reply's forgotten
            self.head_ended = self.content_type_named = self.location_named = False
        elif self.head_ended:  # a trailer
            return
        elif line == b"\r\n" or line == b"\n":
            self.head_ended = True
        else:
            name = line[:13].lower()
            if name == b"content-type:":
                self.content_type_named = True
            elif name[:9] == b"location:":
                self.location_named = True


_Act = Callable[[int, int], None]  # (fd, CSELECT_* bits): hand the socket's readiness to libcurl
_CSELECT_IN, _CSELECT_OUT, _CSELECT_ERR = pycurl.CSELECT_IN, pycurl.CSELECT_OUT, pycurl.CSELECT_ERR


class _LoopWatch:
    """Each socket libcurl watches, watched by the loop's own readers and writers."""

    def __init__(self, loop: asyncio.AbstractEventLoop, act: _Act) -> None:
        self._loop = loop
        self._act = act
        self._watched: dict[int, int] = {}  # fd -> _IN | _OUT bits registered with the loop

    def want(self, fd: int, what: int) -> None:
        wanted = 0 if what == pycurl.POLL_REMOVE else what & (_IN | _OUT)
        had = self._watched.get(fd, 0)
        if wanted == had:
            return
        if had & _IN and not wanted & _IN:
            self._loop.remove_reader(fd)
        if had & _OUT and not wanted & _OUT:
            self._loop.remove_writer(fd)
        if wanted & _IN and not had & _IN:
            self._loop.add_reader(fd, self._act, fd, _CSELECT_IN)
        if wanted & _OUT and not had & _OUT:
            self._loop.add_writer(fd, self._act, fd, _CSELECT_OUT)
        if wanted:
            self._watched[fd] = wanted
        else:
            self._watched.pop(fd, None)

    def watched(self) -> int:
        return len(self._watched)

    def close(self) -> None:
        for fd, bits in self._watched.items():
            if bits & _IN:
                self._loop.remove_reader(fd)
            if bits & _OUT:
                self._loop.remove_writer(fd)
        self._watched.clear()


_PARKED = 0
_EPOLL_EVENTS = {pycurl.POLL_IN: select.EPOLLIN, pycurl.POLL_OUT: select.EPOLLOUT,
                 pycurl.POLL_INOUT: select.EPOLLIN | select.EPOLLOUT} if hasattr(select, "epoll") else {}


class _EpollWatch:
    """The sockets libcurl watches, in an epoll set of the pool's own that the loop watches as one
    descriptor. A socket libcurl stops watching while it only waited to read (a kept-alive connection
    between calls) stays in the set, parked; anything it reports meanwhile (the target closed the
    connection) takes it out, and libcurl finds out itself when it reuses the connection."""

    def __init__(self, loop: asyncio.AbstractEventLoop, act: _Act, after: Callable[[], None]) -> None:
        self._loop = loop
        self._act = act
        self._after = after  # once per wake-up, after every ready socket was handed to libcurl
        self._epoll = select.epoll()
        self._watched: dict[int, int] = {}  # fd -> the epoll events libcurl asked for, or _PARKED
        loop.add_reader(self._epoll.fileno(), self._ready)

    def want(self, fd: int, what: int) -> None:
        had = self._watched.get(fd)
        wanted = _EPOLL_EVENTS.get(what, 0)  # POLL_REMOVE, or POLL_NONE: nothing to wait for
        if not wanted:
            if had == select.EPOLLIN:
                self._watched[fd] = _PARKED
            elif had:
                self._forget(fd)
            return
        if wanted == had:
            return
        try:
            if had is None:
                self._epoll.register(fd, wanted)
            else:  # even from parked: the kernel finds out whether this is still the socket parked there
                self._epoll.modify(fd, wanted)
        except FileNotFoundError:  # the parked socket was closed, and a new one has its number
            self._epoll.register(fd, wanted)
        except FileExistsError:  # forgotten here while the kernel kept it (a socket closed and reopened)
            self._epoll.modify(fd, wanted)
        self._watched[fd] = wanted

    def _forget(self, fd: int) -> None:
        del self._watched[fd]
        with contextlib.suppress(OSError):  # closed already: the kernel took it out of the set
            self._epoll.unregister(fd)

    def _ready(self) -> None:
        try:
            events = self._epoll.poll(0)
        except (OSError, ValueError):  # the pool closed meanwhile (ValueError: the set is closed)
            return
        for fd, happened in events:
            wanted = self._watched.get(fd)
            if not wanted:  # parked: its idle connection was closed or spoke out of turn
                if wanted is not None:
                    self._forget(fd)
                continue
            bits = 0
            if happened & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                bits |= _CSELECT_IN
            if happened & select.EPOLLOUT:
                bits |= _CSELECT_OUT
            if happened & select.EPOLLERR:
                bits |= _CSELECT_ERR
            self._act(fd, bits)
        self._after()

    def watched(self) -> int:
        return len(self._watched)

    def close(self) -> None:
        self._loop.remove_reader(self._epoll.fileno())
        self._epoll.close()
        self._watched.clear()


def _posts(method: str, body: bytes | None) -> bool:
    """Whether :func:`_set_method` has libcurl send a body, an empty one included: one with data, and
    every POST, PUT and PATCH; never a HEAD."""
    return method != "HEAD" and (body is not None or method in ("POST", "PUT", "PATCH"))


def _set_method(curl: pycurl.Curl, method: str, body: bytes | None) -> None:
    """The request's method and body, on a handle that still carries the previous call's."""
    if method == "HEAD":
        curl.setopt(pycurl.CUSTOMREQUEST, None)
        curl.setopt(pycurl.NOBODY, 1)
        return
    curl.setopt(pycurl.NOBODY, 0)  # before the body: clearing it afterwards would make the call a GET
    if not _posts(method, body):
        curl.setopt(pycurl.HTTPGET, 1)
        curl.setopt(pycurl.CUSTOMREQUEST, None if method == "GET" else method)
    else:
        curl.setopt(pycurl.POSTFIELDS, body or b"")  # a POST without a body still says Content-Length: 0
        curl.setopt(pycurl.CUSTOMREQUEST, None if method == "POST" else method)


def _header_lines(headers: Sequence[str], posts: bool, typed: bool) -> Sequence[str]:
    """A request that ``posts`` a body goes without the two headers libcurl would add of its own: a form
    Content-Type (unless the caller's lines give one, ``typed``) and ``Expect: 100-continue`` on a
    large body, which would wait for a target that never answers it. One without, as a GET, gets neither."""
    if not posts:
        return headers
    return [*headers, "Expect:"] if typed else [*headers, "Content-Type:", "Expect:"]


class CurlPool:
    """One connection cache and its transfers, bound to the running loop: one owner's calls (or one
    lane of them, chimes.worker.tasks.http.OwnerPool). ``in_flight``: the calls it carries, kept by
    that owner's pool."""

    def __init__(self, policy: EgressPolicy, *, max_connections: int, max_reply_bytes: int = MAX_REPLY_BYTES,
                 max_idle_sec: int = MAX_IDLE_SEC, own_epoll: bool = True) -> None:
        """``max_reply_bytes``: :data:`MAX_REPLY_BYTES`; ``max_idle_sec``: :data:`MAX_IDLE_SEC` (whole
        seconds, as libcurl counts them); ``own_epoll``: watch the sockets in an epoll set of the pool's
        own where there is epoll (Linux); False, or elsewhere, through the loop's readers and writers."""
        self._loop = asyncio.get_running_loop()
        self._policy = policy
        self._max_reply_bytes = max_reply_bytes
        self._max_idle_sec = max_idle_sec
        self._certificates = _certificates()
        self._multi = pycurl.CurlMulti()
        self._multi.setopt(pycurl.M_SOCKETFUNCTION, self._on_socket)
        self._multi.setopt(pycurl.M_TIMERFUNCTION, self._on_timer)
        self._multi.setopt(pycurl.M_MAX_TOTAL_CONNECTIONS, max_connections)
        self._multi.setopt(pycurl.M_MAXCONNECTS, max_connections)
        self._watch: _LoopWatch | _EpollWatch = (
            _EpollWatch(self._loop, self._socket_ready, self._after_ready) if own_epoll and _EPOLL_EVENTS
            else _LoopWatch(self._loop, self._act))
        self._timer: asyncio.Handle | None = None
        self._timer_due = 0.0  # the loop's time the timer is due at
        self._idle: list[Transfer] = []
        self._active: dict[pycurl.Curl, Transfer] = {}
        self._opened: list[socket.socket] = []
        self.closed = False
        self.in_flight = 0

    @property
    def watched_sockets(self) -> int:
        """The sockets watched for libcurl, idle kept-alive connections parked in the epoll set included."""
        return self._watch.watched()

    async def request(self, method: str, url: str, headers: Sequence[str] = (), body: bytes | None = None, *,
                      host: str, timeout_sec: float, on_body: Callable[[bytes], object] | None = None,
                      typed: bool = False) -> Reply:
        """Call ``url`` once (redirects are the caller's: see :attr:`Reply.redirect_url`) and read its
        reply to the end. ``host``: the URL's, as the egress policy judges it and libcurl resolves it
        (chimes.security.ssrf.outgoing_request); ``headers``: lines as libcurl takes them (``"Name:
        value"``, ``"Name;"`` for an empty value), ``typed`` when one of them is Content-Type;
        ``on_body``: each piece of the decoded body; ``timeout_sec``: for the whole call. Raises
        :class:`CurlError` saying what failed, the target's misbehaviour included."""
        transfer = self.transfer(host, on_body)
        curl = transfer.curl
        curl.setopt(pycurl.URL, url)
        if body is not None or method != transfer.method:
            _set_method(curl, method, body)
            transfer.method = method if body is None else ""
        curl.setopt(pycurl.HTTPHEADER, _header_lines(headers, _posts(method, body), typed))
        curl.setopt(pycurl.TIMEOUT_MS, max(1, round(timeout_sec * 1000)))
        try:
            return await self.perform(transfer)
        finally:
            if body:  # an idle handle would hold it until its next call with a body (the next sets its method)
                with contextlib.suppress(pycurl.error):  # closed: cancelled, or the pool closed
                    curl.setopt(pycurl.POSTFIELDS, b"")

    def transfer(self, host: str, on_body: Callable[[bytes], object] | None) -> Transfer:
        """An easy handle for one call to ``host``; set its request options, then :meth:`perform`."""
        transfer = self._idle.pop() if self._idle else Transfer(self._policy, self._opened, self._certificates,
                                                                self._max_reply_bytes, self._max_idle_sec)
        transfer.start(host, on_body)
        return transfer

    async def perform(self, transfer: Transfer) -> Reply:
        """Run the call and read its reply. Raises :class:`CurlError` when libcurl ends it with an error
        or the reply is not whole. Cancelled, the handle is taken out at once (its connection is closed,
        not kept) and not reused."""
        if self.closed:
            raise RuntimeError("the connection pool is closed")
        future = transfer.future = self._loop.create_future()
        self._active[transfer.curl] = transfer
        self._multi.add_handle(transfer.curl)  # libcurl asks for a timer at once: the call starts from there
        reusable = False
        try:
            try:
                await future
            except CurlError as exc:
                reusable = True  # libcurl ended the call cleanly, with an error to report
                raise _described(exc, transfer, self._max_reply_bytes) from None
            reusable = True
            curl = transfer.curl
            if not transfer.head_ended:  # libcurl takes a head cut short by the close for a whole one
                raise CurlError(pycurl.E_PARTIAL_FILE,
                                "the target closed the connection before its reply's head ended")
            return Reply(curl.getinfo(pycurl.RESPONSE_CODE),
                         curl.getinfo(pycurl.CONTENT_TYPE) if transfer.content_type_named else None,
                         curl.getinfo(pycurl.REDIRECT_URL) if transfer.location_named else None,
                         transfer.delivered)
        except asyncio.CancelledError:
            if self._active.pop(transfer.curl, None) is not None and not self.closed:
                self._multi.remove_handle(transfer.curl)
            raise
        finally:
            transfer.on_body = None
            if reusable and not self.closed:
                self._idle.append(transfer)
            else:
                transfer.curl.close()

    def _on_socket(self, what: int, fd: int, _multi: Any, _data: Any) -> None:
        if not self.closed:  # closing, libcurl may still ask to watch a TLS connection's goodbye
            self._watch.want(fd, what)

    def _on_timer(self, timeout_ms: int) -> None:
        """libcurl's next timeout (-1: none). A handle already due no later is kept: libcurl asks twice a
        call (at once when a call is added, then its timeout), and making and cancelling a handle each
        time cost more than the rest of the timer's work (docs/benchmarks.md). One that fires early is
        harmless: told of a timeout, libcurl does what is due and names its next timeout again, even an
        unchanged one. Nor is one left when libcurl needs none: it then finds nothing to do."""
        if timeout_ms < 0:
            return
        due = self._loop.time() + timeout_ms / 1000
        if self._timer is not None:
            if self._timer_due <= due:
                return
            self._timer.cancel()
        self._timer_due = due
        if timeout_ms == 0:
            self._timer = self._loop.call_soon(self._act, pycurl.SOCKET_TIMEOUT, 0)
        else:
            self._timer = self._loop.call_at(due, self._act, pycurl.SOCKET_TIMEOUT, 0)

    def _act(self, fd: int, events: int) -> None:
        if self.closed:
            return
        if fd == pycurl.SOCKET_TIMEOUT:
            self._timer = None
        self._socket_ready(fd, events)
        self._after_ready()

    def _socket_ready(self, fd: int, events: int) -> None:
        if not self.closed:
            while self._multi.socket_action(fd, events)[0] == pycurl.E_CALL_MULTI_PERFORM:
                pass

    def _after_ready(self) -> None:
        if self.closed:
            return
        if self._opened:  # libcurl connects on its duplicates of these
            for sock in self._opened:
                sock.close()
            self._opened.clear()
        self._finish()

    def _finish(self) -> None:
        while True:
            queued, done, failed = self._multi.info_read()
            for curl in done:
                self._end(curl, None)
            for curl, code, message in failed:
                self._end(curl, CurlError(code, message, curl.getinfo(pycurl.OS_ERRNO)))
            if not queued:
                return

    def _end(self, curl: pycurl.Curl, error: CurlError | None) -> None:
        self._multi.remove_handle(curl)
        transfer = self._active.pop(curl, None)
        if transfer is None or transfer.future is None or transfer.future.done():
            return
        if error is None:
            transfer.future.set_result(None)
        else:
            transfer.future.set_exception(error)

    def close(self) -> None:
        """Close every connection and handle; calls still in flight fail."""
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        for curl, transfer in list(self._active.items()):
            self._multi.remove_handle(curl)
            if transfer.future is not None and not transfer.future.done():
                transfer.future.set_exception(RuntimeError("the connection pool was closed"))
        self._active.clear()
        self._multi.close()
        self._watch.close()
        for transfer in self._idle:
            transfer.curl.close()
        self._idle.clear()


#: What the target did, by the code libcurl ended a call with; libcurl's own words follow.
_WHAT_THE_TARGET_DID = {
    pycurl.E_GOT_NOTHING: "the target closed the connection without a reply",
    pycurl.E_PARTIAL_FILE: "the target closed the connection before its reply's body ended",
    _E_WEIRD_SERVER_REPLY: "the target's reply is not valid HTTP",
    pycurl.E_UNSUPPORTED_PROTOCOL: "the target's reply is not HTTP",  # libcurl: "Received HTTP/0.9"
    pycurl.E_BAD_CONTENT_ENCODING: "the target's compressed body cannot be decoded",
    # libcurl's decoders end a call so when bytes follow the compressed stream's end
    pycurl.E_WRITE_ERROR: "the target sent bytes after its compressed body's end",
    pycurl.E_HTTP2: "the target broke HTTP/2",
    _E_HTTP2_STREAM: "the target broke its HTTP/2 stream",
}


def _described(exc: CurlError, transfer: Transfer, max_bytes: int) -> CurlError:
    """``exc`` with a message that names what the target did, where the code tells, before libcurl's
    own words (a chunk size that is not hex, the bytes missing, ...)."""
    code, said = exc.code, str(exc)
    if transfer.over or code == pycurl.E_FILESIZE_EXCEEDED:
        what = f"the target's reply body is over {max_bytes // (1024 * 1024)} MiB"
        message = what if transfer.over else f"{what} ({said})"
        return CurlError(pycurl.E_FILESIZE_EXCEEDED, message, exc.os_errno, tuple(transfer.refusals))
    if code == _E_TOO_LARGE:
        what = "the target's trailer is over libcurl's bound" if transfer.head_ended else \
            "the target's reply head is over libcurl's bound"
    elif code == pycurl.E_RECV_ERROR:  # libcurl's words say which: a chunk size that is not hex, ...
        what = ("the target reset the connection before its reply ended" if exc.os_errno == errno.ECONNRESET
                else "the target's reply could not be read")
    else:
        what = _WHAT_THE_TARGET_DID.get(code, "")
    message = f"{what}: {said}" if what and said else what or said or f"libcurl error {code}"
    return CurlError(code, message, exc.os_errno, tuple(transfer.refusals))
