"""A real HTTP target on 127.0.0.1 that records every call Chimes makes to it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
from aiohttp import web


@dataclass(frozen=True, slots=True)
class Call:
    path: str
    headers: dict[str, str]
    body: bytes
    received_at: float  # wall clock, epoch seconds

    @property
    def run_id(self) -> str:
        return self.headers["X-Chimes-Run-Id"]

    @property
    def attempt(self) -> int:
        return int(self.headers["X-Chimes-Attempt"])


@dataclass
class Target:
    url: str
    calls: list[Call] = field(default_factory=list)
    # path -> function(call number for that path, 1-based) -> HTTP status
    responders: dict[str, Callable[[int], int]] = field(default_factory=dict)
    # path -> function(call number) -> seconds to wait before answering (a slow or hanging target)
    delays: dict[str, Callable[[int], float]] = field(default_factory=dict)
    # path -> event: calls to that path are answered only once the test sets it (a target held open at will)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    # path -> Location: answered with the responder's status (default 307) and that Location
    redirects: dict[str, str] = field(default_factory=dict)
    # path -> calls being answered now, and the most ever answered at once (a concurrency cap's proof)
    in_flight: dict[str, int] = field(default_factory=dict)
    most_in_flight: dict[str, int] = field(default_factory=dict)

    def calls_to(self, path: str) -> list[Call]:
        return [c for c in self.calls if c.path == path]


@pytest.fixture
async def target() -> AsyncIterator[Target]:
    async with serving_target() as state:
        yield state


@pytest.fixture
async def other_target() -> AsyncIterator[Target]:
    """A second target: another origin (same host, another port)."""
    async with serving_target() as state:
        yield state


@contextlib.asynccontextmanager
async def serving_target() -> AsyncIterator[Target]:
    state = Target(url="")
    closing = asyncio.Event()

    async def handle(request: web.Request) -> web.Response:
        call = Call(request.path, dict(request.headers), await request.read(), time.time())
        state.calls.append(call)
        number = len(state.calls_to(request.path))
        delay = state.delays.get(request.path)
        gate = state.gates.get(request.path)
        now = state.in_flight[request.path] = state.in_flight.get(request.path, 0) + 1
        state.most_in_flight[request.path] = max(now, state.most_in_flight.get(request.path, 0))
        try:
            if delay is not None:  # cut short when the test ends, so teardown never waits on it
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(closing.wait(), timeout=delay(number))
            if gate is not None:  # opened at teardown too (below)
                await gate.wait()
        finally:  # also when the caller went away (a worker killed mid-call)
            state.in_flight[request.path] -= 1
        responder = state.responders.get(request.path)
        location = state.redirects.get(request.path)
        if location is not None:
            return web.Response(status=responder(number) if responder else 307, headers={"Location": location})
        status = responder(number) if responder else 200
        return web.Response(status=status, text=f"answer {status}")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    state.url = f"http://127.0.0.1:{port}"
    yield state
    closing.set()
    for gate in state.gates.values():
        gate.set()
    await runner.cleanup()
