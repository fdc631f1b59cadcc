"""``chimes jobs`` and ``chimes runs`` against the real API: waiting out rate limits, quiet output,
tables that fit the terminal."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
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


async def chimes(api_url: str, token: str, *args: str, columns: int = 80) -> tuple[int, str, str]:
    """The real ``chimes`` command in a process of its own (stderr not a terminal, as in a script)."""
    env = {**os.environ, "CHIMES_TOKEN": token, "CHIMES_API_URL": api_url, "COLUMNS": str(columns)}
    env.pop("CHIMES_LOG_LEVEL", None)
    process = await asyncio.create_subprocess_exec(sys.executable, "-m", "chimes", *args, env=env,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    return process.returncode or 0, out.decode(), err.decode()


async def test_client_commands_print_only_the_answer_and_lists_fit_80_columns(
    api_url: str, tokens: dict[str, str]
) -> None:
    token = tokens["team-a"]
    code, out, err = await chimes(api_url, token, "jobs", "create", "--name", "nightly-report-for-the-data-team",
                                  "--cron", "0 2 * * *", "--timezone", "Europe/Berlin",
                                  "--url", "http://127.0.0.1:9/reports/nightly")
    assert code == 0 and err == "", err
    job_id = out.split()[2]
    await chimes(api_url, token, "jobs", "run", job_id)

    code, out, err = await chimes(api_url, token, "jobs", "list")
    assert code == 0 and err == "", err
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines), out
    [row] = [line for line in lines if job_id[-8:] in line] or [out]
    assert "nightly-report" in row and "0 2 * * *" in row and "in " in row
    assert job_id not in out  # a short id, which every job command takes back:
    code, out, err = await chimes(api_url, token, "jobs", "get", job_id[-8:], "--output", "json")
    assert code == 0 and json.loads(out)["jobId"] == job_id and err == ""

    code, out, err = await chimes(api_url, token, "runs", "list", job_id[-8:])
    assert code == 0 and err == "" and all(len(line) <= 80 for line in out.splitlines())
    assert "manual" in out and "scheduled" in out
    short_run = next(line.split()[0] for line in out.splitlines() if "manual" in line)
    code, out, err = await chimes(api_url, token, "runs", "get", short_run, "--job", job_id[-8:], "-o", "json")
    assert code == 0 and json.loads(out)["runId"].endswith(short_run), err

    # Wide terminals and --wide get whole ids; --verbose shows the HTTP requests.
    code, out, err = await chimes(api_url, token, "jobs", "list", "--wide", "--verbose", columns=200)
    assert code == 0 and job_id in out
    assert "HTTP Request: GET" in err
    code, out, _ = await chimes(api_url, token, "jobs", "list", "--json")
    assert [j["jobId"] for j in json.loads(out)["jobs"]] == [job_id]
