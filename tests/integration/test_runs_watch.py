"""``chimes runs watch`` with its stdout a pipe (a file, a CI log, ``| head``): the real CLI as a
subprocess against the real API prints one line per run as it appears and changes, and stops at
``--until-done`` or at Ctrl-C, cleanly."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from datetime import UTC, datetime, timedelta

import httpx

from tests.integration.fleet import Fleet
from tests.target import Target


async def watch(api_url: str, token: str, *args: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "CHIMES_API_URL": api_url, "CHIMES_TOKEN": token, "CHIMES_LOG_FORMAT": "text"}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "chimes", "runs", "watch", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL)


async def one_off(client: httpx.AsyncClient, target: Target, path: str, seconds: float) -> str:
    at = (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()
    job = {"name": path.strip("/"), "schedule": {"at": at}, "task": {"type": "http", "url": target.url + path},
           "retryPolicy": {"maxAttempts": 1}}
    response = await client.post("/jobs", json=job)
    assert response.status_code == 201, response.text
    return str(response.json()["jobId"])


async def test_watch_into_a_pipe_prints_a_line_per_change_and_stops_when_done(
    fleet: Fleet, client: httpx.AsyncClient, api_url: str, tokens: dict[str, str], target: Target,
) -> None:
    # The call is held open until the watch has printed the run as running: a watch that starts
    # late (a slow machine) would otherwise see only the end of a run that took a fixed second.
    target.gates["/slow"] = answer = asyncio.Event()
    job_id = await one_off(client, target, "/slow", 0.5)
    proc = await watch(api_url, tokens["team-a"], job_id, "--interval", "0.2", "--until-done")
    assert proc.stdout is not None and proc.stderr is not None
    lines: list[str] = []
    async with asyncio.timeout(60):
        while not lines or lines[-1].split()[2] != "running":
            line = await proc.stdout.readline()
            assert line, (lines, await proc.stderr.read())
            lines.append(line.decode().rstrip("\n"))
        answer.set()
        out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    lines += out.decode().splitlines()
    run_id = (await client.get(f"/jobs/{job_id}/runs")).json()["runs"][0]["runId"]
    assert lines and all(line.startswith(run_id) for line in lines), lines
    statuses = [line.split()[2] for line in lines]
    assert statuses[-1] == "succeeded" and "running" in statuses, statuses
    assert len(statuses) == len(set(statuses)), "a line only when the run changes"
    assert "finished=" in lines[-1] and "\x1b" not in "".join(lines), "plain lines, no terminal codes"


async def test_watch_into_a_pipe_stops_cleanly_at_ctrl_c(
    fleet: Fleet, client: httpx.AsyncClient, api_url: str, tokens: dict[str, str], target: Target,
) -> None:
    job_id = await one_off(client, target, "/quick", 0.2)
    proc = await watch(api_url, tokens["team-a"], job_id, "--interval", "0.2")
    assert proc.stdout is not None
    first = await asyncio.wait_for(proc.stdout.readline(), timeout=30)
    assert first.decode().split()[0] in {r["runId"] for r in (await client.get(f"/jobs/{job_id}/runs")).json()["runs"]}
    proc.send_signal(signal.SIGINT)
    _, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 0, err.decode()
    assert "Traceback" not in err.decode() and "Aborted" not in err.decode(), err.decode()
