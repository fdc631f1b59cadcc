"""Request smuggling across teams: a task may not set the framing of its request, and no connection
carries two owners' requests.

The target is a raw asyncio HTTP/1.1 server that keeps connections alive and, as many servers do,
honours ``Transfer-Encoding: chunked`` over ``Content-Length``. A team that sends ``Transfer-Encoding:
chunked`` with a body ending in ``0\\r\\n\\r\\n`` followed by the start of a request leaves that start
on the connection; the next request on it, another team's, is read as the rest of it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from tests.helpers import Homes, auth_as, wait_for
from tests.integration.fleet import Fleet

SECRET = "Bearer team-a-secret-7f3c"
SMUGGLED = "GET /attacker HTTP/1.1\r\nHost: target\r\nX-Swallowed: "


@dataclass
class Received:
    connection: int
    path: str
    headers: dict[str, str]
    raw: bytes


@dataclass
class KeepAliveTarget:
    url: str = ""
    received: list[Received] = field(default_factory=list)

    def paths(self) -> list[str]:
        return [r.path for r in self.received]


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode("latin-1").split("\r\n")
    path = lines[0].split(" ")[1] if len(lines[0].split(" ")) > 1 else ""
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    raw = head
    if "chunked" in headers.get("transfer-encoding", "").lower():  # wins over Content-Length
        while True:
            size_line = await reader.readuntil(b"\r\n")
            raw += size_line
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            chunk = await reader.readexactly(size + 2)
            raw += chunk
            if size == 0:
                break
    elif "content-length" in headers:
        raw += await reader.readexactly(int(headers["content-length"]))
    return path, headers, raw


@pytest.fixture
async def keep_alive_target() -> AsyncIterator[KeepAliveTarget]:
    state = KeepAliveTarget()
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        number = connections
        try:
            while (request := await _read_request(reader)) is not None:
                path, headers, raw = request
                state.received.append(Received(number, path, headers, raw))
                body = f"answer for {path}".encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
                             b"Connection: keep-alive\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    state.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    yield state
    server.close()
    await server.wait_closed()


def _one_off(name: str, task: dict[str, Any]) -> dict[str, Any]:
    at = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    return {"name": name, "schedule": {"at": at}, "task": task, "retryPolicy": {"maxAttempts": 1}}


async def _final_run(client: httpx.AsyncClient, job_id: str) -> dict[str, Any]:
    async def ended() -> dict[str, Any] | None:
        runs = (await client.get(f"/jobs/{job_id}/runs")).json()["runs"]
        done = [r for r in runs if r["status"] in ("succeeded", "failed", "cancelled")]
        return (await client.get(f"/runs/{done[0]['runId']}")).json() if done else None

    return await wait_for(ended, timeout=30, what=f"the run of job {job_id}")


async def test_a_smuggled_request_never_reaches_another_owners_run(
    fleet: Fleet, client: httpx.AsyncClient, tokens: dict[str, str], homes: Homes,
    keep_alive_target: KeepAliveTarget,
) -> None:
    target = keep_alive_target
    attacker = httpx.AsyncClient(base_url=str(client.base_url), headers=auth_as(tokens["team-b"]), timeout=30)
    async with attacker:
        made = await attacker.post("/jobs", json=_one_off("smuggler", {
            "type": "http", "method": "POST", "url": f"{target.url}/harmless", "body": "x"}))
        assert made.status_code == 201, made.text
        job_id = made.json()["jobId"]
        # Written around the API (as an old row or a direct import would be): the worker is the last line.
        hostile = {"type": "http", "method": "POST", "url": f"{target.url}/harmless",
                   "headers": {"Transfer-Encoding": "chunked", "Connection": "keep-alive"},
                   "body": "0\r\n\r\n" + SMUGGLED}
        await (await homes.for_job(job_id)).execute("UPDATE jobs SET task = $1 WHERE job_id = $2", hostile,
                                                    uuid.UUID(job_id))
        attack = await _final_run(attacker, job_id)
    assert attack["status"] in ("succeeded", "failed")

    victim = await client.post("/jobs", json=_one_off("victim", {
        "type": "http", "method": "POST", "url": f"{target.url}/victim", "body": {"pay": 10},
        "secretHeaders": {"Authorization": SECRET}}))
    assert victim.status_code == 201, victim.text
    run = await _final_run(client, victim.json()["jobId"])

    assert "/attacker" not in target.paths(), "the smuggled request was completed by the next one on its connection"
    for request in target.received:
        if request.path != "/victim":
            assert SECRET.encode() not in request.raw, f"team-a's secret reached {request.path}"
    assert run["status"] == "succeeded", run
    assert run["attempts"][-1]["output"] == "answer for /victim", "the victim got the answer to its own request"
    # No connection ever carried both owners' requests.
    owners_by_job = {row["job_id"]: row["owner"] for row in await homes.fetch("SELECT job_id, owner FROM jobs")}
    seen: dict[int, set[str]] = {}
    for request in target.received:
        job = request.headers.get("x-chimes-job-id")
        if job is not None:
            seen.setdefault(request.connection, set()).add(owners_by_job[uuid.UUID(job)])
    assert all(len(owners) == 1 for owners in seen.values()), seen


REFUSED_HEADERS = ["Content-Length", "transfer-encoding", "Connection", "Keep-Alive", "TE", "Trailer", "Upgrade",
                   "Expect", "Host", "Proxy-Authorization", "proxy-connection"]


@pytest.mark.parametrize("field_name", ["headers", "secretHeaders"])
@pytest.mark.parametrize("header", REFUSED_HEADERS)
async def test_the_api_refuses_framing_and_hop_by_hop_headers(
    client: httpx.AsyncClient, homes: Homes, header: str, field_name: str
) -> None:
    task = {"type": "http", "url": "http://example.com/", field_name: {header: "chunked"}}
    response = await client.post("/jobs", json=_one_off("framing", task))
    assert response.status_code == 422, response.text
    error = response.json()
    assert error["field"].startswith(f"task.{field_name}"), error
    assert f"header {header!r} may not be set by a task" in error["message"], error
    assert await homes.total("SELECT count(*) FROM jobs") == 0


@pytest.mark.parametrize(("value", "words"), [
    ("a\x0bb", "control character '\\x0b'"), ("a\x1fb", "control character '\\x1f'"),
    ("a\x7fb", "control character '\\x7f'"), ("a\x00b", "NUL"), ("a\rb", "line break"),
])
@pytest.mark.parametrize("field_name", ["headers", "secretHeaders"])
async def test_the_api_refuses_control_characters_in_header_values(
    client: httpx.AsyncClient, homes: Homes, value: str, words: str, field_name: str
) -> None:
    task = {"type": "http", "url": "http://example.com/", field_name: {"X-Value": value}}
    response = await client.post("/jobs", json=_one_off("controls", task))
    assert response.status_code == 422, response.text
    assert response.json()["field"].startswith(f"task.{field_name}")
    assert words in response.json()["message"], response.json()
    assert await homes.total("SELECT count(*) FROM jobs") == 0


async def test_a_tab_in_a_header_value_is_fine(client: httpx.AsyncClient) -> None:
    task = {"type": "http", "url": "http://example.com/", "headers": {"X-Value": "a\tb"}}
    assert (await client.post("/jobs", json=_one_off("tab", task))).status_code == 201
