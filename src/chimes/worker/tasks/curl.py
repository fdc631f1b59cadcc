"""libcurl's multi interface, driven by the running asyncio loop: the client of HTTP tasks.

A :class:`CurlPool` is one ``pycurl.CurlMulti``, that is one cache of kept-alive connections, and the
easy handles that go through it. libcurl does the HTTP (framing, keep-alive, TLS, HTTP/2, happy
eyeballs, its own threaded name lookups); this module only tells it when a socket is ready or a timer
is due (``socket_action``), through the loop's readers, writers and timers, so a call costs a few
callbacks instead of a Python HTTP stack's per-request objects: on the 2-core machine of
docs/benchmarks.md a kept-alive POST costs this worker about a third of the CPU it cost through
aiohttp (``python -m bench burst``'s worker CPU per run, side by side).

Every connection is opened through :meth:`Transfer._open_socket` (``CURLOPT_OPENSOCKETFUNCTION``),
which libcurl calls with the address it is about to connect to, after its name lookup: the egress
policy judges that very address, so no lookup can be swapped in between (DNS rebinding). libcurl
forbids calling back into it from its callbacks; the socket and timer callbacks here only register
with the loop, and the loop's callbacks call ``socket_action``.

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
import select
import socket
import ssl
from collections.abc import Callable
from typing import Any, NamedTuple

import pycurl

from chimes.security.ssrf import EgressPolicy

__all__ = ["CurlError", "CurlPool", "Reply", "Transfer"]

_IN, _OUT = 1, 2  # pycurl.POLL_IN and POLL_OUT as bits: POLL_INOUT is both
_ONLY_HTTP = pycurl.PROTO_HTTP | pycurl.PROTO_HTTPS


class CurlError(Exception):
    """A call that libcurl ended with an error: ``code`` is its CURLE_* number, ``os_errno`` the
    system's error behind it (ECONNREFUSED, ...), ``refusals`` why the egress policy refused the
    addresses it would not connect to."""

    def __init__(self, code: int, message: str, os_errno: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.os_errno = os_errno
        self.refusals: tuple[str, ...] = ()


class Reply(NamedTuple):
    """What a call's caller reads of the response besides its body (which went to ``on_body``). A
    named tuple: one is made per call."""

    status: int
    content_type: str | None
    redirect_url: str | None  # the Location header as an absolute URL, resolved by libcurl


class Transfer:
    """One easy handle, reused call after call, and what the current call collects: the response
    body (through ``on_body``), the egress refusals of the addresses it would not connect to, and
    whether the body was cut short on purpose (``stopped``: ``on_body`` returned False)."""

    __slots__ = ("_opened", "_policy", "curl", "future", "host", "method", "on_body", "refusals", "stopped")

    def __init__(self, policy: EgressPolicy, verify: ssl.DefaultVerifyPaths, opened: list[socket.socket]) -> None:
        self._policy = policy
        self._opened = opened  # sockets whose descriptor pycurl has duplicated: the pool closes ours
        self.curl = pycurl.Curl()
        self.future: asyncio.Future[None] | None = None
        self.host = ""
        self.method = ""  # the method set on the handle, when without a body: the next such call's is already set
        self.on_body: Any = None  # (bytes) -> bool: False stops the transfer
        self.refusals: list[str] = []
        self.stopped = False
        curl = self.curl
        curl.setopt(pycurl.NOSIGNAL, 1)  # no SIGALRM or SIGPIPE games inside an event loop
        curl.setopt(pycurl.PROXY, "")  # never a proxy from the environment: the egress check is on the target
        curl.setopt(pycurl.PROTOCOLS, _ONLY_HTTP)
        curl.setopt(pycurl.OPENSOCKETFUNCTION, self._open_socket)
        curl.setopt(pycurl.WRITEFUNCTION, self._write)
        curl.setopt(pycurl.ACCEPT_ENCODING, "gzip, deflate")  # decoded before the output tail sees it
        # The certificates Python's own ssl module trusts (SSL_CERT_FILE and SSL_CERT_DIR included),
        # not the paths the library was built with, which another distribution may not have.
        if verify.cafile:
            curl.setopt(pycurl.CAINFO, verify.cafile)
        if verify.capath:
            curl.setopt(pycurl.CAPATH, verify.capath)

    def start(self, host: str, on_body: Any) -> None:
        self.host = host
        self.on_body = on_body
        self.refusals.clear()
        self.stopped = False

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
        if self.on_body(chunk):
            return None
        self.stopped = True
        return 0  # anything but len(chunk): libcurl ends the transfer with CURLE_WRITE_ERROR


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


class CurlPool:
    """One connection cache and its transfers, bound to the running loop. ``in_flight``: the calls
    it carries, kept by its owner's pool (chimes.worker.tasks.http.OwnerPool)."""

    def __init__(self, policy: EgressPolicy, *, max_connections: int, own_epoll: bool = True) -> None:
        """``own_epoll``: watch the sockets in an epoll set of the pool's own where there is epoll
        (Linux); False, or elsewhere, through the loop's readers and writers."""
        self._loop = asyncio.get_running_loop()
        self._policy = policy
        self._verify = ssl.get_default_verify_paths()
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

    def transfer(self, host: str, on_body: Any) -> Transfer:
        """An easy handle for one call to ``host``; set its request options, then :meth:`perform`."""
        transfer = self._idle.pop() if self._idle else Transfer(self._policy, self._verify, self._opened)
        transfer.start(host, on_body)
        return transfer

    async def perform(self, transfer: Transfer) -> Reply:
        """Run the call and read its reply. Raises :class:`CurlError` when libcurl ends it with an
        error, unless the body was stopped on purpose. Cancelled, the handle is taken out at once
        (its connection is closed, not kept) and not reused."""
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
                if not (exc.code == pycurl.E_WRITE_ERROR and transfer.stopped):
                    exc.refusals = tuple(transfer.refusals)
                    raise
            reusable = True
            curl = transfer.curl
            return Reply(curl.getinfo(pycurl.RESPONSE_CODE), curl.getinfo(pycurl.CONTENT_TYPE),
                         curl.getinfo(pycurl.REDIRECT_URL))
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
