"""An explicit ``--egress-allow`` of a default-denied network means it: a real ``chimes worker``
started with ``CHIMES_EGRESS_ALLOW=127.0.0.0/8`` and loopback otherwise denied calls a target on
127.0.0.1, and says at start-up that the allow entry turned that part of the defaults on."""

from __future__ import annotations

import httpx

from tests.e2e.processes import Processes
from tests.e2e.test_crash_safety import soon
from tests.integration.test_outgoing_calls import final_run
from tests.target import Target


async def test_an_explicit_loopback_allow_lets_the_worker_call_loopback(
    processes: Processes, client: httpx.AsyncClient, target: Target,
) -> None:
    assert target.url.startswith("http://127.0.0.1:")
    egress = {"CHIMES_EGRESS_ALLOW_LOOPBACK": "false", "CHIMES_EGRESS_ALLOW": "127.0.0.0/8",
              "CHIMES_LOG_FORMAT": "text"}
    processes.start("scheduler", "scheduler", "--node-id", "node-1", "--lease-ttl", "3", env=egress)
    worker = processes.start("worker", "worker", "--worker-id", "worker-1", "--lease-sec", "3", env=egress)
    job = {"name": "loopback", "schedule": {"at": soon(0.3)}, "task": {"type": "http", "url": f"{target.url}/ok"},
           "retryPolicy": {"maxAttempts": 1}}
    job_id = (await client.post("/jobs", json=job)).json()["jobId"]

    run = await final_run(client, job_id)
    assert run["status"] == "succeeded", run["attempts"]
    assert len(target.calls_to("/ok")) == 1
    assert "127.0.0.0/8 is allowed (--egress-allow), lifting that part of the default-denied 127.0.0.0/8" \
        in worker.output()
