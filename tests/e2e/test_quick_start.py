"""The README's quick start, as a new user runs it: `chimes up`, a token, a job with curl-like HTTP."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from tests.e2e.processes import Processes
from tests.helpers import free_port, wait_for
from tests.target import Target

TOKEN = re.compile(r"^\s+(chm_\S+)\s*$", re.MULTILINE)


@pytest.mark.single_database("`chimes up` on the embedded server of its own data dir: no shard map")
async def test_chimes_up_runs_everything_on_embedded_postgres(
    processes: Processes, tmp_path: Path, target: Target
) -> None:
    data_dir = tmp_path / "data"
    port = free_port()
    env = {k: v for k, v in processes.env.items() if k != "CHIMES_DATABASE_URL"}
    processes.env = env  # the embedded server, as a new user has it
    up = processes.start("up", "up", "--data-dir", str(data_dir), "--port", str(port))
    token = (await wait_for(lambda: TOKEN.search(up.output()), timeout=90, what="the admin token")).group(1)
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {token}"}) as http:
        await wait_for(lambda: _healthy(http), timeout=30, what="the API")
        at = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
        created = await http.post("/jobs", json={"name": "hello", "schedule": {"at": at},
                                                 "task": {"type": "http", "url": f"{target.url}/hello"}})
        assert created.status_code == 201, created.text
        job_id = created.json()["jobId"]
        job = (await http.get(f"/jobs/{job_id}")).json()
        assert job["nextRunAt"] == created.json()["nextRunAt"]
        await wait_for(lambda: target.calls_to("/hello"), timeout=20, what="the job to call the target")
        runs = await wait_for(lambda: _succeeded_runs(http, job_id), timeout=20, what="a succeeded run")
        assert runs[0]["status"] == "succeeded"

        # Another command on the same data dir shares the running server.
        made = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "chimes", "token", "create", "--owner", "team-x", "--data-dir", str(data_dir),
            env=env, stdout=asyncio.subprocess.PIPE,
        )
        stdout, _ = await asyncio.wait_for(made.communicate(), timeout=60)
        assert made.returncode == 0
        team_token = stdout.decode().strip()
        assert team_token.startswith("chm_")
        password = (data_dir / "postgres.password").read_text().strip()
        assert password not in up.output() and password not in stdout.decode(), "the database password was shown"
        mine = await http.get("/jobs", headers={"Authorization": f"Bearer {team_token}"})
        assert mine.status_code == 200 and mine.json()["jobs"] == []

    up.signal(signal.SIGTERM)
    assert await up.exited(timeout=60) == 0, up.output()[-4000:]
    assert not (data_dir / "postgres" / "postmaster.pid").exists(), "the embedded server was left running"
    # A second start reuses the data and prints no new token.
    again = processes.start("up-again", "up", "--data-dir", str(data_dir), "--port", str(port))
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {token}"}) as http:
        await wait_for(lambda: _healthy(http), timeout=60, what="the API after a restart")
        assert (await http.get(f"/jobs/{job_id}")).status_code == 200
    assert TOKEN.search(again.output()) is None


async def _healthy(http: httpx.AsyncClient) -> bool:
    try:
        return (await http.get("/healthz")).status_code == 200
    except httpx.TransportError:
        return False


async def _succeeded_runs(http: httpx.AsyncClient, job_id: str) -> list[dict] | None:
    runs = (await http.get(f"/jobs/{job_id}/runs", params={"status": "succeeded"})).json()["runs"]
    return runs or None
