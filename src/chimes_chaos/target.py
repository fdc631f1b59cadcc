"""The HTTP target of a chaos run: a real aiohttp server on 127.0.0.1 that records every call.

Each call is a *delivery*: its run id, attempt, ``Idempotency-Key``, lease token, arrival time and
the answer the target chose. The answer body names the delivery (``{"delivery": 17, "answer": 200}``),
and a worker stores that body as the attempt's output, so the invariant checker can tell exactly
which call produced each recorded outcome.

What a call gets is decided by the job's own behaviour (query parameters of its URL: ``fail`` is the
probability of answering 500, ``work`` the seconds it takes) unless a fault mode is on:
``errors`` answers 503, ``hang`` never answers in time, ``close`` drops the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from aiohttp import web

MODES = ("normal", "errors", "hang", "close")
HANG_SEC = 120.0  # far past every chaos job's timeout: the worker gives up first


@dataclass(frozen=True, slots=True)
class Delivery:
    number: int
    path: str
    run_id: str | None
    attempt: int | None
    idempotency_key: str | None
    lease_token: str | None
    received_at: float  # epoch seconds
    answer: str  # "200", "500", "503" (fault), "hang", "close"

    @property
    def succeeded(self) -> bool:
        return self.answer.startswith("2")


class ChaosTarget:
    """Serve on ``host`` (127.0.0.1 unless the fleet is in zones), record deliveries in memory and,
    one JSON line each, in ``log_path``."""

    def __init__(self, log_path: Path, seed: int | str, host: str = "127.0.0.1") -> None:
        self.log_path = log_path
        self.host = host
        self.deliveries: list[Delivery] = []
        self.mode = "normal"
        self.url = ""
        self._rng = random.Random(f"{seed}-target")
        self._closing = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._log: IO[str] | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0, backlog=512)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{self.host}:{port}"
        self._log = self.log_path.open("a", encoding="utf-8")
        return self.url

    async def stop(self) -> None:
        self._closing.set()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._log is not None:
            self._log.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        answer = self._choose(request)
        delivery = self._record(request, answer)
        if answer == "close":
            # Drop the connection without a response, as a crashing server or a proxy would.
            if request.transport is not None:
                request.transport.abort()
            raise asyncio.CancelledError
        work = HANG_SEC if answer == "hang" else _number(request.query.get("work"), 0.0)
        if work > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), timeout=work)
        status = 200 if answer == "hang" else int(answer)
        body = json.dumps({"delivery": delivery.number, "answer": status})
        return web.Response(status=status, text=body, content_type="application/json")

    def _choose(self, request: web.Request) -> str:
        if self.mode == "errors":
            return "503"
        if self.mode in ("hang", "close"):
            return self.mode
        return "500" if self._rng.random() < _number(request.query.get("fail"), 0.0) else "200"

    def _record(self, request: web.Request, answer: str) -> Delivery:
        headers = request.headers
        attempt = headers.get("X-Chimes-Attempt")
        delivery = Delivery(
            number=len(self.deliveries) + 1, path=request.path, run_id=headers.get("X-Chimes-Run-Id"),
            attempt=int(attempt) if attempt and attempt.isdigit() else None,
            idempotency_key=headers.get("Idempotency-Key"), lease_token=headers.get("X-Chimes-Lease-Token"),
            received_at=time.time(), answer=answer,
        )
        self.deliveries.append(delivery)
        if self._log is not None:
            self._log.write(json.dumps(asdict(delivery)) + "\n")
            self._log.flush()
        return delivery


def delivery_number(output: str | None) -> int | None:
    """The delivery named in an attempt's output (the target's answer body), if it holds one."""
    if not output:
        return None
    try:
        number = json.loads(output).get("delivery")
    except (ValueError, AttributeError):
        return None
    return number if isinstance(number, int) else None


def _number(text: str | None, default: float) -> float:
    try:
        return float(text) if text is not None else default
    except ValueError:
        return default
