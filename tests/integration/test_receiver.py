"""The receiver SDK in real target apps, called by a real Chimes (API, scheduler node, worker).

The same two endpoints are built as a FastAPI app served by uvicorn and as an aiohttp app, both on
127.0.0.1, and every test runs against each: ``/report`` verifies and deduplicates, ``/export``
answers 202 and reports through the callbacks. Forged and stale requests are sent by the test itself.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx
import pytest
import uvicorn
from aiohttp import web
from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from chimes.receiver import ChimesCall, Receiver, Seen
from chimes.receiver import aiohttp as aiohttp_receiver
from chimes.receiver.asgi import chimes_call
from chimes.receiver.callbacks import MAX_OUTPUT_CHARS
from chimes.security.secrets import default_keyring
from chimes.security.signing import SIGNATURE_HEADER, signature_header
from chimes.services.owners import signing_secret
from chimes.store.owners import OwnerStore
from tests.helpers import Homes, wait_for
from tests.integration.fleet import Fleet


@dataclass
class App:
    """A target app's own state: the work it did, the raw requests it got, the gate of its long work."""

    url: str = ""
    receiver: Receiver | None = None
    done: list[ChimesCall] = field(default_factory=list)
    raw: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def long_work(self, call: ChimesCall) -> str:
        await self.release.wait()
        if call.body == b'{"fail":true}':
            raise RuntimeError("export crashed")
        if call.body == b'{"fail":"binary"}':
            raise RuntimeError("disk\x00full")
        self.done.append(call)
        if call.body == b'{"binary":true}':  # text PostgreSQL cannot hold, longer than the API takes
            return "a\x00b" + "x" * 5000
        return "42 rows"


def fastapi_app(receiver: Receiver, state: App) -> FastAPI:
    app = FastAPI()
    get_call = chimes_call(receiver)

    @app.post("/report")
    async def report(request: Request) -> Response:  # Starlette style: the call awaited in the handler
        state.raw.append((dict(request.headers), await request.body()))
        call = await get_call(request)
        async with receiver.deduplicate(call) as seen:
            if seen is Seen.FIRST:
                state.done.append(call)
        return JSONResponse({"seen": seen.value}, status_code=seen.status)

    @app.post("/export")
    async def export(call: ChimesCall = Depends(get_call)) -> Response:  # noqa: B008  # FastAPI style
        return Response(status_code=await receiver.accept(call, state.long_work))

    return app


def aiohttp_app(receiver: Receiver, state: App) -> web.Application:
    async def report(request: web.Request) -> web.Response:
        state.raw.append((dict(request.headers), await request.read()))
        call = await aiohttp_receiver.chimes_call(receiver, request)
        async with receiver.deduplicate(call) as seen:
            if seen is Seen.FIRST:
                state.done.append(call)
        return web.json_response({"seen": seen.value}, status=seen.status)

    async def export(request: web.Request) -> web.Response:
        call = await aiohttp_receiver.chimes_call(receiver, request)
        return web.Response(status=await receiver.accept(call, state.long_work))

    app = web.Application()
    app.router.add_post("/report", report)
    app.router.add_post("/export", export)
    return app


@pytest.fixture(params=["fastapi", "aiohttp"])
async def app(request: pytest.FixtureRequest, fleet: Fleet, pool: asyncpg.Pool, api_url: str,
              tokens: dict[str, str]) -> AsyncIterator[App]:
    """The target app of one framework, with team-a's signing secret and token, on 127.0.0.1."""
    secret = await signing_secret(OwnerStore(pool), "team-a", default_keyring())
    receiver = Receiver(secret, api_url=api_url, token=tokens["team-a"], heartbeat_every_sec=0.3)
    state = App(receiver=receiver)
    if request.param == "fastapi":
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(fastapi_app(receiver, state), log_level="warning", lifespan="off",
                                               log_config=None))
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        await wait_for(lambda: server.started or serving.done(), timeout=10, what="uvicorn to start")
        state.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        yield state
        server.should_exit = True
        await serving
        sock.close()
    else:
        runner = web.AppRunner(aiohttp_app(receiver, state), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        state.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        yield state
        await runner.cleanup()
    await receiver.aclose()


def job(app: App, path: str, **task: object) -> dict:
    at = (datetime.now(UTC) + timedelta(seconds=0.3)).isoformat()
    return {"name": path.strip("/"), "schedule": {"at": at}, "retryPolicy": {"maxAttempts": 1},
            "task": {"type": "http", "method": "POST", "url": app.url + path} | task}


async def final_run(client: httpx.AsyncClient, job_id: str) -> dict:
    async def finished() -> dict | None:
        runs = (await client.get(f"/jobs/{job_id}/runs")).json()["runs"]
        done = [r for r in runs if r["status"] in ("succeeded", "failed", "cancelled")]
        return (await client.get(f"/runs/{done[0]['runId']}")).json() if done else None

    run: dict = await wait_for(finished, timeout=20, what=f"a run of {job_id} to finish")
    return run


def signed(headers: dict[str, str], signature: str) -> dict[str, str]:
    """``headers`` with another signature (names compared case-insensitively, as HTTP does)."""
    return {k: v for k, v in headers.items() if k.lower() != SIGNATURE_HEADER.lower()} | {SIGNATURE_HEADER: signature}


async def test_verified_calls_expose_the_run_and_forged_or_stale_ones_are_refused(
    app: App, client: httpx.AsyncClient
) -> None:
    job_id = (await client.post("/jobs", json=job(app, "/report", body={"day": 1}))).json()["jobId"]
    run = await final_run(client, job_id)
    assert run["status"] == "succeeded", run
    [call] = app.done
    assert (call.run_id, call.job_id, call.attempt, call.idempotency_key) == (run["runId"], job_id, 1, run["runId"])
    assert call.scheduled_at == datetime.fromisoformat(run["scheduledAt"]) and call.body == b'{"day":1}'

    [(headers, body)] = app.raw
    secret = app.receiver._secrets[0]  # type: ignore[union-attr]
    forged = signed(headers, signature_header("whsec_not-the-secret", int(time.time()), body))
    stale = signed(headers, signature_header(secret, int(time.time()) - 600, body))
    changed_body = body.replace(b"1", b"2")
    async with httpx.AsyncClient(base_url=app.url) as http:
        refusals = [await http.post("/report", headers=forged, content=body),
                    await http.post("/report", headers=stale, content=body),
                    await http.post("/report", headers=headers, content=changed_body),
                    await http.post("/report", headers={"X-Chimes-Run-Id": call.run_id}, content=body)]
    assert [answer.status_code for answer in refusals] == [401, 401, 401, 401]
    assert "does not match" in refusals[0].text and "beyond the tolerance of 300 s" in refusals[1].text
    assert "does not match" in refusals[2].text and "no signature header" in refusals[3].text
    assert len(app.done) == 1  # no refused call did the work


async def test_a_replayed_call_is_deduplicated(app: App, client: httpx.AsyncClient) -> None:
    job_id = (await client.post("/jobs", json=job(app, "/report"))).json()["jobId"]
    assert (await final_run(client, job_id))["status"] == "succeeded"
    [(headers, body)] = app.raw
    # The captured call, sent again verbatim within the signature's tolerance: valid, and a duplicate.
    async with httpx.AsyncClient(base_url=app.url) as http:
        again = await http.post("/report", headers=headers, content=body)
    assert again.status_code == 200 and again.json() == {"seen": "done"}
    assert len(app.raw) == 2 and len(app.done) == 1


async def test_long_work_answers_202_heartbeats_and_completes_the_run(
    app: App, client: httpx.AsyncClient, homes: Homes
) -> None:
    ok = (await client.post("/jobs", json=job(app, "/export", callback=True))).json()["jobId"]
    failing = (await client.post("/jobs", json=job(app, "/export", callback=True, body={"fail": True}))).json()

    async def lease_extended(job_id: str) -> bool:
        # The worker's own lease is 3 s (FAST_WORKER); only the receiver's heartbeats make it 30 s.
        expires = await homes.fetchval(job_id, "SELECT l.expires_at FROM run_leases l JOIN runs r ON r.run_id ="
                                       " l.run_id WHERE r.job_id = $1", uuid.UUID(job_id))
        return expires is not None and expires > datetime.now(UTC) + timedelta(seconds=20)

    await wait_for(lambda: lease_extended(ok), timeout=10, what="the receiver to heartbeat")
    await wait_for(lambda: lease_extended(failing["jobId"]), timeout=10, what="the receiver to heartbeat")
    app.release.set()
    run = await final_run(client, ok)
    assert run["status"] == "succeeded", run
    assert run["attempts"][-1]["output"] == "42 rows"
    assert [call.run_id for call in app.done] == [run["runId"]]
    failed = await final_run(client, failing["jobId"])
    assert (failed["status"], failed["error"]) == ("failed", "RuntimeError: export crashed")


async def test_long_work_whose_output_the_api_would_refuse_is_reported_storable(
    app: App, client: httpx.AsyncClient
) -> None:
    """A NUL, or more text than POST /runs/{id}/complete takes, in what the work returned or raised:
    the receiver reports it replaced and cut, rather than have the report refused (422) and the run
    reaped and done again."""
    binary = (await client.post("/jobs", json=job(app, "/export", callback=True, body={"binary": True}))).json()
    failing = (await client.post("/jobs", json=job(app, "/export", callback=True, body={"fail": "binary"}))).json()
    app.release.set()
    run = await final_run(client, binary["jobId"])
    assert run["status"] == "succeeded", run
    assert run["attempts"][-1]["output"] == "a\ufffdb" + "x" * (MAX_OUTPUT_CHARS - 3)
    failed = await final_run(client, failing["jobId"])
    assert (failed["status"], failed["error"]) == ("failed", "RuntimeError: disk\ufffdfull")
    assert len(app.done) == 1, "the work was done once"
