"""The operator's security commands, as real processes: token scopes, owner settings, signing
secrets, and a worker that refuses to start with a secret key that is not the database's."""

from __future__ import annotations

import asyncio
import sys

import httpx
import pytest
from cryptography.fernet import Fernet

from tests.e2e.processes import Processes
from tests.helpers import auth_as

pytestmark = pytest.mark.e2e


async def chimes(processes: Processes, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "chimes", *args, env={**processes.env, "CHIMES_LOG_FORMAT": "text", **(env or {})},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    return proc.returncode or 0, out.decode()


async def test_token_scopes_from_the_command_line(processes: Processes, api_url: str) -> None:
    code, read_token = await chimes(processes, "token", "create", "--owner", "team-x", "--scope", "read")
    assert code == 0 and read_token.strip().startswith("chm_")
    code, out = await chimes(processes, "token", "create", "--owner", "team-x", "--admin", "--scope", "read")
    assert code != 0 and "--admin contradicts --scope read" in out
    code, listing = await chimes(processes, "token", "list")
    assert code == 0 and "team-x" in listing and "read" in listing
    async with httpx.AsyncClient(base_url=api_url, headers=auth_as(read_token.strip())) as http:
        assert (await http.get("/jobs")).status_code == 200
        assert (await http.post("/jobs", json={})).status_code == 403
        token_id = next(line.split()[1] for line in listing.splitlines() if "team-x" in line)
        code, out = await chimes(processes, "token", "revoke", token_id)
        assert code == 0, out
        assert (await http.get("/jobs")).status_code == 401


async def test_owner_settings_and_signing_secret_from_the_command_line(processes: Processes) -> None:
    code, out = await chimes(processes, "owner", "set", "team-x", "--allow-commands", "--job-quota", "3")
    assert (code, out.strip()) == (0, "team-x: command tasks allowed, job quota 3")
    code, out = await chimes(processes, "owner", "set", "team-x", "--default-quota")
    assert out.strip() == "team-x: command tasks allowed, job quota the API's default"
    code, listing = await chimes(processes, "owner", "list")
    assert code == 0 and "team-x" in listing and "allowed" in listing
    code, first = await chimes(processes, "owner", "signing-secret", "team-x")
    code, same = await chimes(processes, "owner", "signing-secret", "team-x")
    code, rotated = await chimes(processes, "owner", "signing-secret", "team-x", "--rotate")
    assert first.strip().startswith("whsec_") and first == same and rotated != first


async def test_a_worker_with_another_secret_key_stops_at_start_up(processes: Processes) -> None:
    code, _ = await chimes(processes, "owner", "signing-secret", "team-x")  # the database now has a key
    assert code == 0
    worker = processes.start("worker", "worker", "--worker-id", "stranger",
                             env={"CHIMES_SECRET_KEY": Fernet.generate_key().decode(), "CHIMES_LOG_FORMAT": "text"})
    assert await worker.exited(timeout=60) != 0
    assert "is not the key the secrets in this database are sealed with" in worker.output()
