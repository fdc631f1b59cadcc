"""``chimes jobs`` and ``chimes runs`` against the real API: waiting out rate limits, quiet output,
tables that fit the terminal."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import httpx
import pytest
from click.testing import CliRunner, Result

from chimes.api.app import create_app
from chimes.api.limits import LimitSettings
from chimes.cli import client
from chimes.cli.runtime import api_server
from tests.helpers import wait_for


async def serve(app: object) -> AsyncIterator[str]:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = api_server(app, "127.0.0.1", sock.getsockname()[1])
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await wait_for(lambda: server.started or task.done(), timeout=10, what="API start")
    assert server.started, "the API did not start"
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.stop()
    await task
    sock.close()


@pytest.fixture
async def limited_api_url(database_url: str) -> AsyncIterator[str]:
    """The real API with a low write limit: 2 writes a second per token, bursts of 2."""
    async for url in serve(create_app(database_url, pool_size=4,
                                      limits=LimitSettings(writes_per_sec=2.0, write_burst=2))):
        yield url


async def cli(args: list[str], url: str, token: str, columns: int = 80) -> Result:
    env = {"CHIMES_TOKEN": token, "CHIMES_API_URL": url, "COLUMNS": str(columns)}
    return await asyncio.to_thread(CliRunner().invoke, client.jobs if args[0] == "jobs" else client.runs,
                                   args[1:], env=env)


async def test_the_cli_waits_out_a_write_limit(limited_api_url: str, tokens: dict[str, str]) -> None:
    token = tokens["team-a"]
    for n in range(6):
        result = await cli(["jobs", "create", "--name", f"job-{n}", "--cron", "0 2 * * *",
                            "--url", "http://127.0.0.1:9/hook"], limited_api_url, token)
        assert result.exit_code == 0, result.output
    async with httpx.AsyncClient(base_url=limited_api_url, headers={"Authorization": f"Bearer {token}"}) as http:
        jobs = (await http.get("/jobs")).json()["jobs"]
    assert sorted(j["name"] for j in jobs) == [f"job-{n}" for n in range(6)]
