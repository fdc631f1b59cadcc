"""`chimes api` as a real process at start-up: a secret key that is not the database's and a port in
use each end it with one line and a non-zero exit, and "API listening" is said only once the port is
served."""

from __future__ import annotations

import asyncio
import socket
import sys

import httpx
import pytest
from cryptography.fernet import Fernet

from tests.e2e.processes import Processes
from tests.helpers import free_port, wait_for

pytestmark = pytest.mark.e2e

LISTENING = "API listening on"


async def chimes(processes: Processes, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "chimes", *args, env={**processes.env, "CHIMES_LOG_FORMAT": "text", **(env or {})},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=90)
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace")


def lines_with(output: str, text: str) -> list[str]:
    return [line for line in output.splitlines() if text in line]


async def test_an_api_with_another_secret_key_stops_with_one_line(processes: Processes) -> None:
    code, _ = await chimes(processes, "owner", "signing-secret", "team-x")  # the database now has a key
    assert code == 0
    code, output = await chimes(processes, "api", "--port", str(free_port()),
                                env={"CHIMES_SECRET_KEY": Fernet.generate_key().decode()})
    assert code != 0, output
    assert "Traceback" not in output, output
    [line] = lines_with(output, "is not the key the secrets in this database are sealed with")
    assert line.startswith("Error: this process's secret key"), output
    assert LISTENING not in output, output


async def test_an_api_whose_port_is_taken_stops_with_one_line_and_never_says_it_listens(
    processes: Processes
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code, output = await chimes(processes, "api", "--port", str(port))
    assert code != 0, output
    assert "Traceback" not in output, output
    [line] = lines_with(output, f"cannot listen on 127.0.0.1:{port}")
    assert line.startswith("Error: the API cannot listen") and "Address already in use" in line, output
    assert LISTENING not in output, output


async def test_the_api_says_it_listens_once_it_answers(processes: Processes) -> None:
    port = free_port()
    api = processes.start("api", "api", "--port", str(port), env={"CHIMES_LOG_FORMAT": "text"})
    await wait_for(lambda: LISTENING in api.output() or api.proc.poll() is not None, timeout=60,
                   what="the API to say it listens")
    assert api.proc.poll() is None, api.output()
    [line] = lines_with(api.output(), LISTENING)
    assert f"http://127.0.0.1:{port}" in line, line
    async with httpx.AsyncClient() as http:  # at once, without a retry: the app has started and the port is served
        healthz = await http.get(f"http://127.0.0.1:{port}/healthz")
    assert healthz.status_code == 200, healthz.text
    assert api.stop() == 0, api.output()
