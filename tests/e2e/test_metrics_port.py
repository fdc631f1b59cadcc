"""Real `chimes scheduler` and `chimes worker` processes: each serves its own metrics on
--metrics-port, and logs JSON lines (their stderr is a file) with run and job ids on lines about runs."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.processes import Processes
from tests.helpers import free_port, wait_for
from tests.target import Target


async def sample(port: int, name: str, **labels: str) -> float | None:
    async with httpx.AsyncClient(timeout=5) as http:
        try:
            response = await http.get(f"http://127.0.0.1:{port}/metrics")
        except httpx.TransportError:
            return None  # not listening yet
    for family in text_string_to_metric_families(response.text):
        for found in family.samples:
            if found.name == name and found.labels == labels:
                return found.value
    return None


async def test_scheduler_and_worker_serve_their_own_metrics_and_log_json(
    processes: Processes, client: httpx.AsyncClient, target: Target,
) -> None:
    target.responders["/fail"] = lambda _: 500
    scheduler_port, worker_port = free_port(), free_port()
    processes.start("scheduler", "scheduler", "--node-id", "metrics-node", "--lease-ttl", "3",
                    "--metrics-port", str(scheduler_port), "--metrics-host", "127.0.0.1")
    worker = processes.start("worker", "worker", "--worker-id", "metrics-worker", "--lease-sec", "3",
                             "--metrics-port", str(worker_port), "--metrics-host", "127.0.0.1")
    every_second = {"name": "tick", "schedule": {"cron": "* * * * * *"},
                    "task": {"type": "http", "url": f"{target.url}/tick"}}
    assert (await client.post("/jobs", json=every_second)).status_code == 201
    at = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    broken = {"name": "broken", "schedule": {"at": at}, "task": {"type": "http", "url": f"{target.url}/fail"},
              "retryPolicy": {"maxAttempts": 1}}
    broken_id = (await client.post("/jobs", json=broken)).json()["jobId"]

    async def at_least(port: int, name: str, minimum: float, **labels: str) -> bool:
        found = await sample(port, name, **labels)
        return found is not None and found >= minimum

    await wait_for(lambda: at_least(scheduler_port, "chimes_partitions_owned", 1024), timeout=60,
                   what="the scheduler's metrics to show all partitions held")
    await wait_for(lambda: at_least(scheduler_port, "chimes_fire_lag_seconds_count", 3), timeout=30,
                   what="fire lag observations")
    await wait_for(lambda: at_least(worker_port, "chimes_runs_finished_total", 3, status="succeeded"), timeout=30,
                   what="succeeded runs counted by the worker")
    await wait_for(lambda: at_least(worker_port, "chimes_runs_finished_total", 1, status="failed"), timeout=30,
                   what="the failed run counted by the worker")
    assert await sample(worker_port, "chimes_partitions_owned") == 0  # each role counts only what it does
    assert await sample(scheduler_port, "chimes_runs_finished_total", status="succeeded") is None

    lines = [json.loads(line) for line in worker.output().splitlines() if line.startswith("{")]
    assert lines and all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
    failures = [line for line in lines if "failed after attempt" in line["message"]]
    assert failures and failures[0]["job_id"] == broken_id and failures[0]["run_id"] in failures[0]["message"]
    assert "HTTP 500" in failures[0]["message"]
