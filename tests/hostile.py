"""A hostile HTTP target: a listener on 127.0.0.1, in a process of its own, whose paths each do one
thing wrong (scripted below, byte for byte). It runs apart so that what it holds and spends is not
counted as the client's: a test measures the memory of the process that makes the calls.

``python -m tests.hostile`` prints its port and serves until its standard input closes. Every path it
was asked for is kept, in order, and answered as JSON at ``/_asked`` (a test checks that a trap was
never called). A connection's requests are read one after the other, as a naive server reads them: a
reply sent before the request's body was read leaves that body to be read as the next request.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

BOMB_BYTES = 1 << 30  # the zeros the decompression bomb decodes to
HEAD_LIMIT = 64 << 20  # bytes read without a head's end that are dropped, unanswered
METHODS = {b"GET", b"HEAD", b"POST", b"PUT", b"PATCH", b"DELETE", b"OPTIONS"}

_ZEROS = bytes(1 << 20)


def _bomb() -> Iterator[bytes]:
    """A gzip stream of :data:`BOMB_BYTES` zeros, made as it is sent from one compressed block: each
    MiB of zeros ends with a full flush, so every block after the first is the same few bytes."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    yield compressor.compress(_ZEROS) + compressor.flush(zlib.Z_FULL_FLUSH)
    block = compressor.compress(_ZEROS) + compressor.flush(zlib.Z_FULL_FLUSH)
    crc = zlib.crc32(_ZEROS, zlib.crc32(_ZEROS))
    for _ in range(BOMB_BYTES // len(_ZEROS) - 1):
        yield block
        crc = zlib.crc32(_ZEROS, crc)
    yield b"\x03\x00" + struct.pack("<II", crc, BOMB_BYTES & 0xFFFFFFFF)  # an empty final block, the trailer


def _forever(piece: bytes) -> Iterator[bytes]:
    while True:
        yield piece


def _reset(conn: socket.socket) -> None:
    """Close with a TCP reset (RST), not a FIN."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


SMUGGLED = b"HTTP/1.1 500 Not Yours\r\nContent-Length: 9\r\n\r\nnot yours"  # a body that reads as a reply


@dataclass
class Served:
    """What a path sends: its bytes (or a stream of them, sent until the client stops reading), the
    pause between pieces, and how the connection ends: kept (the next request read on it), closed,
    or reset."""

    reply: bytes = b""
    stream: Callable[[], Iterator[bytes]] | None = None
    pause_sec: float = 0.0
    then: str = "keep"  # "keep", "close" or "reset"
    after_sec: float = 0.0  # waited before the end (a close or a reset)


def _ok(body: bytes, *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\n" + b"".join(line + b"\r\n" for line in extra) + \
        b"Content-Length: %d\r\n\r\n" % len(body) + body


DRIP = b"one byte at a time!"

PATHS: dict[str, Served] = {
    "/healthy": Served(_ok(b"healthy")),
    "/after": Served(_ok(b"after")),
    "/second": Served(_ok(b"second")),
    "/trap": Served(_ok(b"trapped")),
    "/status-then-close": Served(b"HTTP/1.1 200 OK\r\n", then="close"),
    "/200-then-close": Served(b"HTTP/1.1 200", then="close"),
    "/body-then-reset": Served(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nthe start of a body",
                               then="reset", after_sec=0.2),
    "/gzip-then-endless": Served(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\n\r\n" + gzip.compress(b"hello"),
                                 stream=lambda: _forever(b"x" * 65536)),
    "/endless-body": Served(b"HTTP/1.1 200 OK\r\n\r\n", stream=lambda: _forever(b"x" * 65536)),
    "/endless-trailer": Served(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nX-Trailer: ",
                               stream=lambda: _forever(b"a" * 65536)),
    "/endless-header": Served(b"HTTP/1.1 200 OK\r\nX-Endless: ", stream=lambda: _forever(b"a" * 65536)),
    "/slow-drip": Served(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(DRIP),
                         stream=lambda: iter([bytes([b]) for b in DRIP]), pause_sec=0.05),
    "/bad-chunk-size": Served(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nok\r\n0\r\n\r\n"),
    "/overflowing-chunk-size": Served(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\nok\r\n0\r\n\r\n"),
    "/short-body": Served(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this", then="close"),
    # A reply that may not have a body, with one that reads as another reply: a client that reused the
    # connection would take it for its next call's.
    "/head-with-body": Served(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(SMUGGLED), SMUGGLED)),
    "/204-with-body": Served(b"HTTP/1.1 204 No Content\r\n\r\n" + SMUGGLED),
    "/304-with-body": Served(b"HTTP/1.1 304 Not Modified\r\n\r\n" + SMUGGLED),
    # An interim reply whose headers would change the final reply's if they carried over: its charset,
    # its encoding, its length, its Location.
    "/interim-then-final": Served(
        b"HTTP/1.1 103 Early Hints\r\nContent-Type: text/plain; charset=utf-16\r\nContent-Encoding: gzip\r\n"
        b"Content-Length: 3\r\nLocation: /trap\r\nLink: </a.css>; rel=preload\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"),
    "/interim-location-then-302": Served(
        b"HTTP/1.1 103 Early Hints\r\nLocation: /trap\r\n\r\nHTTP/1.1 302 Found\r\nContent-Length: 0\r\n\r\n"),
    "/early-reply": Served(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 8\r\n\r\ntoo long"),
    "/redirect-loop": Served(b"HTTP/1.1 302 Found\r\nLocation: /redirect-loop\r\nContent-Length: 0\r\n\r\n"),
    "/decompression-bomb": Served(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\n\r\n", stream=_bomb),
}


# What a worker must make of each path: the matrix of tests/unit/test_hostile_targets.py and
# tests/integration/test_hostile_targets.py.

UPLOAD = "a" * (8 * 1024 * 1024)  # more than the socket buffers hold: the target answers while it is sent


@dataclass(frozen=True)
class Row:
    """A call to a path, and the run's true outcome."""

    path: str
    succeeded: bool
    said: str  # in the run's error when it failed, in its output when it succeeded
    method: str = "GET"
    body: str | None = None
    then: tuple[str, str, str] | None = None  # a call after it on the same pool: method, path, its output
    asked: int = 1  # how often the target was asked for ``path``


ROWS = {
    "status line then close": Row("/status-then-close", False,
                                  "the target closed the connection before its reply's head ended"),
    "200 then close": Row("/200-then-close", False, "the target closed the connection without a reply"),
    "close-delimited body then reset": Row("/body-then-reset", False,
                                           "the target reset the connection before its reply ended"),
    "small gzip member then endless bytes": Row("/gzip-then-endless", False,
                                                "the target sent bytes after its compressed body's end"),
    "endless body": Row("/endless-body", False, "the target's reply body is over 16 MiB"),
    "chunked reply whose trailer never ends": Row("/endless-trailer", False,
                                                  "the target's trailer is over libcurl's bound"),
    "endless header": Row("/endless-header", False, "the target's reply head is over libcurl's bound"),
    "slow drip within the timeout": Row("/slow-drip", True, DRIP.decode()),
    "bad chunk size": Row("/bad-chunk-size", False,
                          "the target's reply could not be read: chunk hex-length char not a hex digit"),
    "overflowing chunk size": Row("/overflowing-chunk-size", False, "the target's reply could not be read: "),
    "body shorter than its Content-Length": Row("/short-body", False,
                                                "the target closed the connection before its reply's body ended"),
    "HEAD with a body": Row("/head-with-body", True, "", method="HEAD", then=("GET", "/after", "after")),
    "204 with a body": Row("/204-with-body", True, "", then=("GET", "/after", "after")),
    "304 with a body": Row("/304-with-body", False, "HTTP 304", then=("GET", "/after", "after")),
    "1xx then a final reply": Row("/interim-then-final", True, "hello"),
    "1xx Location then a 302 without one": Row("/interim-location-then-302", False, "HTTP 302"),
    "early reply during a large upload": Row("/early-reply", False, "HTTP 413", method="POST", body=UPLOAD,
                                             then=("POST", "/second", "second")),
    "redirect loop": Row("/redirect-loop", False, "more than 10 redirects", asked=11),
    "decompression bomb": Row("/decompression-bomb", False, "the target's reply body is over 16 MiB"),
}


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        conn: socket.socket = self.request
        pending = bytearray()
        with contextlib.suppress(OSError):
            while True:
                end = pending.find(b"\r\n\r\n")
                while end < 0:
                    data = conn.recv(65536)
                    if not data:
                        return
                    searched = max(0, len(pending) - 3)
                    pending += data
                    end = pending.find(b"\r\n\r\n", searched)
                    if end < 0 and len(pending) > HEAD_LIMIT:  # no head ever: dropped
                        pending.clear()
                head, pending = bytes(pending[:end]), pending[end + 4:]
                words = head.split(b"\r\n", 1)[0].split(b" ")
                if len(words) != 3 or words[0] not in METHODS:  # not a request: a body read as one, say
                    self.server.asked("?")
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 11\r\n\r\nnot for you")
                    continue
                path = words[1].decode("latin-1")
                self.server.asked(path)
                if path == "/_asked":
                    conn.sendall(_ok(json.dumps(self.server.paths).encode()))
                    continue
                served = PATHS.get(path)
                if served is None:
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    continue
                if not self._serve(conn, served):
                    return

    def _serve(self, conn: socket.socket, served: Served) -> bool:
        conn.sendall(served.reply)
        for piece in served.stream() if served.stream else ():
            if served.pause_sec:
                time.sleep(served.pause_sec)
            conn.sendall(piece)
        if served.then == "keep":
            return True
        time.sleep(served.after_sec)
        if served.then == "reset":
            _reset(conn)
        else:
            conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        return False


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.paths: list[str] = []
        self._lock = threading.Lock()

    def asked(self, path: str) -> None:
        with self._lock:
            self.paths.append(path)


@dataclass
class HostileTarget:
    """The target's process, as a test holds it."""

    process: subprocess.Popen[bytes]
    url: str
    stopped: bool = field(default=False)

    def asked(self) -> list[str]:
        with socket.create_connection(("127.0.0.1", int(self.url.rsplit(":", 1)[1])), timeout=10) as conn:
            conn.sendall(b"GET /_asked HTTP/1.1\r\nHost: hostile\r\n\r\n")
            reply = b""
            while not reply.endswith(b"]"):
                reply += conn.recv(65536)
        paths: list[str] = json.loads(reply.partition(b"\r\n\r\n")[2])
        return [path for path in paths if path != "/_asked"]

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            assert self.process.stdin is not None
            self.process.stdin.close()
            self.process.wait(timeout=10)
            assert self.process.stdout is not None
            self.process.stdout.close()


class MemoryWatch:
    """This process's resident memory, sampled every few milliseconds on a thread of its own (so a
    blocked event loop is sampled too): the most it grew above what it was at the start."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._start = self._process.memory_info().rss
        self._most = self._start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self._most = max(self._most, self._process.memory_info().rss)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self._most - self._start


@contextlib.contextmanager
def hostile_target() -> Iterator[HostileTarget]:
    process = subprocess.Popen([sys.executable, "-m", "tests.hostile"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, cwd=Path(__file__).parents[1])
    assert process.stdout is not None
    port = int(process.stdout.readline())
    target = HostileTarget(process, f"http://127.0.0.1:{port}")
    try:
        yield target
    finally:
        target.stop()


if __name__ == "__main__":
    server = _Server()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(server.server_address[1], flush=True)
    sys.stdin.read()  # until the test closes it, or ends
    server.shutdown()
