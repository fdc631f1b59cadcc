"""The API while the database cannot be reached: 503 with Retry-After, at once or at the request's
own timeout, never a 500 and never a hang."""

from __future__ import annotations

import asyncio
import time

import asyncpg
import httpx
from fastapi import FastAPI

from chimes import outage
from chimes.api import errors, unavailable


def app_with(deadline: float) -> FastAPI:
    app = FastAPI()
    errors.install(app)
    unavailable.install(app)
    never = asyncio.Event()

    @app.get("/hangs")
    async def hangs() -> dict:
        await never.wait()  # a statement on a connection whose host vanished
        return {}

    @app.get("/timeout")
    async def timeout() -> dict:
        raise TimeoutError  # a statement timed out (asyncpg's command_timeout)

    @app.get("/lost")
    async def lost() -> dict:
        raise asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation")

    @app.get("/shard-lost")
    async def shard_lost() -> dict:
        lost = asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation")
        outage.blame(lost, outage.Database("shard 2", "shard 2 (10.0.0.3:5432/chimes_2)"))  # as the store does
        raise lost

    @app.get("/bug")
    async def bug() -> dict:
        raise ValueError("a bug, not the database")

    @app.get("/fine")
    async def fine() -> dict:
        return {"ok": True}

    app.add_middleware(unavailable.RequestDeadline, seconds=deadline)
    return app


async def call(app: FastAPI, path: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
        return await client.get(path)


async def test_a_request_waiting_on_the_database_past_its_timeout_gets_503() -> None:
    started = time.monotonic()
    response = await call(app_with(0.3), "/hangs")
    assert time.monotonic() - started < 2
    assert response.status_code == 503
    assert response.headers["Retry-After"] == str(unavailable.RETRY_AFTER_SEC)
    assert response.json()["error"] == "database_unavailable"


async def test_database_errors_get_503_and_other_errors_stay_500() -> None:
    app = app_with(5)
    for path in ("/timeout", "/lost"):
        response = await call(app, path)
        assert response.status_code == 503, path
        assert "Retry-After" in response.headers
    assert (await call(app, "/bug")).status_code == 500
    assert (await call(app, "/fine")).json() == {"ok": True}


async def test_a_503_names_the_role_of_the_database_that_failed_and_never_its_host() -> None:
    app = app_with(5)
    named = (await call(app, "/shard-lost")).json()["message"]
    assert named.startswith("the database (shard 2) is unavailable now"), named
    assert "10.0.0.3" not in named
    unnamed = (await call(app, "/lost")).json()["message"]
    assert unnamed.startswith("the database is unavailable now"), unnamed
