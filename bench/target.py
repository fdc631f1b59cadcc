"""The fast local HTTP target every system calls: answers 200 at once and notes when each call came.

Runs in its own process (``python -m bench.target PORT_FILE``) so its CPU is nobody's and it is the
same for every system. A call is identified by ``X-Chimes-Run-Id`` when present, else by its path;
``GET /_stats`` returns every arrival (its time, key and path), ``GET /_count`` their number,
``POST /_reset`` forgets them.

It shares the machine's cores with the system under test, so it is an HTTP/1.1 server of a few
lines on the event loop's own protocol (keep-alive, ``Content-Length`` and chunked bodies, ``Expect:
100-continue``) rather than a framework's: aiohttp's server spent about 38 CPU µs a call, a fifth of
the CPU a whole 10,000-run burst takes, in the very second the systems are measured; this one 12-13
(docs/benchmarks.md, "The machine, and how busy it was").
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import cast

import httpx
import orjson

from bench.procs import Proc, python

_OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"
_CLOSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_MAX_HEAD = 64 * 1024


class _Request:
    __slots__ = ("body_left", "chunked", "close", "expects_continue", "key", "path")

    def __init__(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3:
            raise ValueError(f"not an HTTP request line: {lines[0][:100]!r}")
        self.path = parts[1].split(b"?", 1)[0].decode("latin-1")
        self.key = self.path
        self.body_left = 0
        self.chunked = False
        self.expects_continue = False
        self.close = parts[2] == b"HTTP/1.0"
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            value = value.strip()
            if name == b"content-length":
                self.body_left = int(value)
            elif name == b"x-chimes-run-id":
                self.key = value.decode("latin-1")
            elif name == b"transfer-encoding":
                self.chunked = b"chunked" in value.lower()
            elif name == b"connection":
                self.close = value.lower() == b"close" or (self.close and value.lower() != b"keep-alive")
            elif name == b"expect":
                self.expects_continue = value.lower() == b"100-continue"


class _Connection(asyncio.Protocol):
    """One client connection: requests one after the other (no client here pipelines)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.buffer = b""
        self.request: _Request | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one, without the base class

    def data_received(self, data: bytes) -> None:
        self.buffer = self.buffer + data if self.buffer else data
        try:
            while self._step():
                pass
        except ValueError as exc:
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                                 % (len(str(exc)), str(exc).encode()))
            self.transport.close()

    def _step(self) -> bool:
        """Consume what the buffer holds of the current request; True if something was consumed."""
        if self.request is None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > _MAX_HEAD:
                    raise ValueError("request head too large")
                return False
            head, self.buffer = self.buffer[:end], self.buffer[end + 4:]
            self.request = _Request(head)
            if self.request.expects_continue and self.transport is not None:
                self.transport.write(_CONTINUE)
            self.target.arrived(self.request)
            return True
        request = self.request
        if request.chunked:
            return self._chunk(request)
        if request.body_left:
            taken = min(request.body_left, len(self.buffer))
            request.body_left -= taken
            self.buffer = self.buffer[taken:]
            if request.body_left:
                return False
        self._answer(request)
        return True

    def _chunk(self, request: _Request) -> bool:
        line_end = self.buffer.find(b"\r\n")
        if line_end < 0:
            return False
        size = int(self.buffer[:line_end].split(b";", 1)[0], 16)
        if size == 0:  # the last chunk, then trailers up to an empty line
            end = self.buffer.find(b"\r\n\r\n", line_end - 2 if line_end >= 2 else 0)
            if end < 0:
                return False
            self.buffer = self.buffer[end + 4:]
            request.chunked = False
            self._answer(request)
            return True
        if len(self.buffer) < line_end + 2 + size + 2:
            return False
        self.buffer = self.buffer[line_end + 2 + size + 2:]
        return True

    def _answer(self, request: _Request) -> None:
        assert self.transport is not None
        self.request = None
        self.transport.write(self.target.answer(request))
        if request.close:
            self.transport.close()


_CONTROL = frozenset({"/_stats", "/_count", "/_reset"})


class Target:
    """Every call's arrival: when its head was read (wall clock), its key and its path."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[float, str, str]] = []

    def arrived(self, request: _Request) -> None:
        if request.path not in _CONTROL:
            self.arrivals.append((time.time(), request.key, request.path))

    def answer(self, request: _Request) -> bytes:
        path = request.path
        if path not in _CONTROL:
            return _CLOSE if request.close else _OK
        if path == "/_stats":
            arrivals = self.arrivals
            body = orjson.dumps({"times": [a[0] for a in arrivals], "keys": [a[1] for a in arrivals],
                                 "paths": [a[2] for a in arrivals]})
            return _response(body, b"application/json", request.close)
        if path == "/_count":
            return _response(str(len(self.arrivals)).encode(), b"text/plain", request.close)
        self.arrivals.clear()  # /_reset
        return _response(b"reset", b"text/plain", request.close)


def _response(body: bytes, content_type: bytes, close: bool) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n%s"
            % (content_type, len(body), b"Connection: close\r\n" if close else b"", body))


async def serve(port_file: Path) -> None:
    target = Target()
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(lambda: _Connection(target), "127.0.0.1", 0, backlog=4096)
    port = listener.sockets[0].getsockname()[1]
    _announce(port_file, port)
    await asyncio.Event().wait()


def _announce(port_file: Path, port: int) -> None:
    port_file.write_text(str(port))


class TargetProcess:
    """The target, started in its own process; ``url`` is its base URL."""

    def __init__(self, workdir: Path) -> None:
        port_file = workdir / "target.port"
        port_file.unlink(missing_ok=True)
        self.proc = Proc("target", python("-m", "bench.target", str(port_file)), workdir / "target.log")
        deadline = time.monotonic() + 20
        while not port_file.exists() or not port_file.read_text():
            if time.monotonic() > deadline or not self.proc.alive():
                raise RuntimeError(f"the HTTP target did not start:\n{self.proc.log_tail()}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port_file.read_text()}"

    async def reset(self) -> None:
        async with httpx.AsyncClient() as client:
            (await client.post(f"{self.url}/_reset")).raise_for_status()

    async def arrivals(self) -> tuple[list[float], list[str]]:
        data = await self._stats()
        return data["times"], data["keys"]

    async def deliveries(self) -> list[tuple[float, str, str]]:
        """Every call: when it came (wall clock), its key (the run id) and its path."""
        data = await self._stats()
        return list(zip(data["times"], data["keys"], data["paths"], strict=True))

    async def _stats(self) -> dict[str, list]:
        async with httpx.AsyncClient(timeout=60) as client:
            answer = (await client.get(f"{self.url}/_stats")).raise_for_status()
        return orjson.loads(answer.content)

    async def count(self) -> int:
        async with httpx.AsyncClient() as client:
            return int((await client.get(f"{self.url}/_count")).raise_for_status().text)

    def stop(self) -> None:
        self.proc.stop(timeout=5)


def main() -> None:
    import uvloop

    uvloop.run(serve(Path(sys.argv[1])))


if __name__ == "__main__":
    main()
