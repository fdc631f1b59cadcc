"""The fast local HTTP target every system calls: answers 200 and notes when each call came.

Runs in its own process (``python -m bench.target PORT_FILE``) so its CPU is nobody's and it is the
same for every system. A call is identified by ``X-Chimes-Run-Id`` when present, else by its path;
``GET /_stats`` returns every arrival (its time, key and path) and the most calls it held at once,
``GET /_count`` their number, ``POST /_reset?hold_ms=N`` forgets them and from then on answers each
call N milliseconds after its head arrived (0, the default: at once). Held a while, the calls a
client has in flight overlap at the target, which so counts them: the concurrency a system really
ran at, whatever its settings say.

It shares the machine's cores with the system under test, so it is an HTTP/1.1 server of a few
lines on the event loop's own protocol (keep-alive, ``Content-Length`` and chunked bodies, ``Expect:
100-continue``) rather than a framework's, which spent three times the CPU a call in the very second
the systems are measured (docs/benchmarks.md, "The machine, and how busy it was").
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any, cast

import httpx
import orjson

from bench.procs import Proc, python

_OK = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"
_CLOSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_MAX_HEAD = 64 * 1024


class _Request:
    __slots__ = ("body_left", "chunked", "close", "expects_continue", "key", "path", "query")

    def __init__(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3:
            raise ValueError(f"not an HTTP request line: {lines[0][:100]!r}")
        path, _, query = parts[1].partition(b"?")
        self.path = path.decode("latin-1")
        self.query = query.decode("latin-1")
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
        self.request = None
        hold = self.target.hold_sec
        if hold and request.path not in _CONTROL:
            asyncio.get_running_loop().call_later(hold, self._send, request)
        else:
            self._send(request)

    def _send(self, request: _Request) -> None:
        assert self.transport is not None
        answer = self.target.answer(request)
        if self.transport.is_closing():  # the client gave up on the call while it was held
            return
        self.transport.write(answer)
        if request.close:
            self.transport.close()


_CONTROL = frozenset({"/_stats", "/_count", "/_reset"})


class Target:
    """Every call's arrival: when its head was read (wall clock), its key and its path; and the calls
    in flight (head read, answer not yet written), with the most there were at once."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[float, str, str]] = []
        self.hold_sec = 0.0
        self.in_flight = 0
        self.most_in_flight = 0

    def arrived(self, request: _Request) -> None:
        if request.path not in _CONTROL:
            self.arrivals.append((time.time(), request.key, request.path))
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)

    def answer(self, request: _Request) -> bytes:
        path = request.path
        if path not in _CONTROL:
            self.in_flight -= 1
            return _CLOSE if request.close else _OK
        if path == "/_stats":
            arrivals = self.arrivals
            body = orjson.dumps({"times": [a[0] for a in arrivals], "keys": [a[1] for a in arrivals],
                                 "paths": [a[2] for a in arrivals], "most_in_flight": self.most_in_flight})
            return _response(body, b"application/json", request.close)
        if path == "/_count":
            return _response(str(len(self.arrivals)).encode(), b"text/plain", request.close)
        try:  # /_reset
            self.hold_sec = _hold_ms(request.query) / 1000
        except ValueError as exc:
            return _response(str(exc).encode(), b"text/plain", request.close, b"400 Bad Request")
        self.arrivals.clear()
        self.most_in_flight = self.in_flight
        return _response(b"reset", b"text/plain", request.close)


def _hold_ms(query: str) -> float:
    for part in query.split("&"):
        name, _, value = part.partition("=")
        if name == "hold_ms":
            hold = float(value)
            if not 0 <= hold <= 60_000:
                raise ValueError(f"hold_ms must be 0 to 60000, not {value}")
            return hold
    return 0.0


def _response(body: bytes, content_type: bytes, close: bool, status: bytes = b"200 OK") -> bytes:
    return (b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n%s"
            % (status, content_type, len(body), b"Connection: close\r\n" if close else b"", body))


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

    async def reset(self, hold_ms: float = 0) -> None:
        """Forget every call; answer each call from now on ``hold_ms`` after its head arrived."""
        async with httpx.AsyncClient() as client:
            (await client.post(f"{self.url}/_reset", params={"hold_ms": hold_ms})).raise_for_status()

    async def arrivals(self) -> tuple[list[float], list[str]]:
        data = await self._stats()
        return data["times"], data["keys"]

    async def most_in_flight(self) -> int:
        """The most calls the target held at once since the last reset."""
        return int((await self._stats())["most_in_flight"])

    async def deliveries(self) -> list[tuple[float, str, str]]:
        """Every call: when it came (wall clock), its key (the run id) and its path."""
        data = await self._stats()
        return list(zip(data["times"], data["keys"], data["paths"], strict=True))

    async def _stats(self) -> dict[str, Any]:
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
