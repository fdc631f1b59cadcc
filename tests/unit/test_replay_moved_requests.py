"""chimes.api.moved.ReplayMovedRequests at the ASGI level, called as chimes.api.standby.StandbyReads
calls it: a second time, with the same ``receive``, for a read the primary did not answer. A small
Starlette app stands in for Chimes' handlers: what is tested is what the middleware hands on, and
tests/e2e/test_zone_outage.py reads from a real standby through the whole app."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message

from chimes.api.moved import ReplayMovedRequests
from chimes.store.shards import ShardMap, ShardPools


def scope_of(method: str) -> dict[str, Any]:
    shards = ShardPools(None, ShardMap(1, ()))  # type: ignore[arg-type]  # no catalog: no map is read here
    return {"type": "http", "method": method, "path": "/jobs", "raw_path": b"/jobs", "query_string": b"",
            "headers": [], "app": SimpleNamespace(state=SimpleNamespace(shards=shards))}


def client_sending(*messages: Message) -> asyncio.Queue[Message]:
    """The client's side of ``receive``: these messages, then nothing until it leaves."""
    client: asyncio.Queue[Message] = asyncio.Queue()
    for message in messages:
        client.put_nowait(message)
    return client


async def call(middleware: ASGIApp, method: str, client: asyncio.Queue[Message], answers: list[Message]) -> None:
    async def send(message: Message) -> None:
        answers.append(message)

    await asyncio.wait_for(middleware(scope_of(method), client.get, send), timeout=5)


async def test_a_read_made_a_second_time_with_the_same_receive_is_answered_again() -> None:
    async def jobs(request: Request) -> JSONResponse:
        return JSONResponse({"method": request.method})

    middleware = ReplayMovedRequests(Starlette(routes=[Route("/jobs", jobs)]))
    client = client_sending({"type": "http.request", "body": b"", "more_body": False})
    answers: list[Message] = []
    for _ in range(2):  # the second as StandbyReads makes it, from the standby
        await call(middleware, "GET", client, answers)
    assert [m["status"] for m in answers if m["type"] == "http.response.start"] == [200, 200]
    assert [m["body"] for m in answers if m["type"] == "http.response.body" and m["body"]] == [b'{"method":"GET"}'] * 2


async def test_a_write_reads_its_body_once_and_gets_all_of_it() -> None:
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"body": (await request.body()).decode()})

    middleware = ReplayMovedRequests(Starlette(routes=[Route("/jobs", echo, methods=["POST"])]))
    client = client_sending({"type": "http.request", "body": b'{"name":', "more_body": True},
                            {"type": "http.request", "body": b'"a"}', "more_body": False})
    answers: list[Message] = []
    await call(middleware, "POST", client, answers)
    body = b"".join(m["body"] for m in answers if m["type"] == "http.response.body")
    assert body == b'{"body":"{\\"name\\":\\"a\\"}"}'
    assert client.empty()
