"""Prometheus metrics, scraped from the real /metrics after real runs: counts must match what happened.

Metrics live in one registry per process, and every test in this session shares it, so each test
compares a scrape after with a scrape before.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from datetime import UTC, datetime, timedelta

import httpx
from prometheus_client.parser import text_string_to_metric_families

from chimes.scheduler.node import SchedulerNode
from chimes.store.working import WorkerStore
from tests.helpers import Homes, auth_as, wait_for
from tests.integration.fleet import FAST_SCHEDULER, Fleet
from tests.target import Target

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(client: httpx.AsyncClient) -> Samples:
    response = await client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def one_off(name: str, url: str, **extra: object) -> dict:
    at = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    return {"name": name, "schedule": {"at": at}, "task": {"type": "http", "method": "POST", "url": url}, **extra}


async def test_runs_retries_lags_and_durations_are_counted_exactly(
    fleet: Fleet, client: httpx.AsyncClient, target: Target,
) -> None:
    target.responders["/flaky"] = lambda n: 500 if n == 1 else 200
    target.responders["/fail"] = lambda _: 500
    backoff = {"initialBackoffSec": 1, "maxBackoffSec": 1, "jitter": 0}
    before = await scrape(client)
    bodies = [one_off(f"ok-{i}", f"{target.url}/ok") for i in range(3)]
    bodies.append(one_off("flaky", f"{target.url}/flaky", retryPolicy={"maxAttempts": 3, **backoff}))
    bodies.append(one_off("broken", f"{target.url}/fail", retryPolicy={"maxAttempts": 2, **backoff}))
    job_ids = []
    for body in bodies:
        response = await client.post("/jobs", json=body)
        assert response.status_code == 201, response.text
        job_ids.append(response.json()["jobId"])

    async def all_final() -> bool:
        for job_id in job_ids:
            last = (await client.get(f"/jobs/{job_id}")).json()["lastRun"]
            if not last or last["status"] not in ("succeeded", "failed"):
                return False
        return True

    await wait_for(all_final, timeout=40, what="every run to end")
    await wait_for(lambda: len(fleet.node.leases.held) == 1024, timeout=10, what="all partitions held")
    after = await scrape(client)

    assert delta(after, before, "chimes_runs_finished_total", status="succeeded") == 4
    assert delta(after, before, "chimes_runs_finished_total", status="failed") == 1
    assert delta(after, before, "chimes_run_retries_total", by="worker") == 2
    assert delta(after, before, "chimes_task_duration_seconds_count", type="http", status="succeeded") == 4
    assert delta(after, before, "chimes_task_duration_seconds_count", type="http", status="failed") == 3
    assert delta(after, before, "chimes_start_lag_seconds_count") == 5  # first attempts only
    # 5 schedule triggers and 2 retry triggers fired, each with its lag observed.
    assert delta(after, before, "chimes_triggers_fired_total") == 7
    assert delta(after, before, "chimes_fire_lag_seconds_count") == 7
    assert 0 <= delta(after, before, "chimes_fire_lag_seconds_sum") < 7 * 5
    assert delta(after, before, "chimes_fire_lag_seconds_bucket", le="+Inf") == 7
    assert delta(after, before, "chimes_api_request_duration_seconds_count",
                 method="POST", route="/jobs", status="201") == 5
    assert delta(after, before, "chimes_api_request_duration_seconds_count",
                 method="GET", route="/jobs/{job_id}", status="200") >= 5
    assert value(after, "chimes_partitions_owned") == 1024
    assert value(after, "chimes_partitions_unleased") == 0
    assert value(after, "chimes_scheduler_nodes_live") == 1 and value(after, "chimes_workers_live") == 1


async def test_queue_depth_counts_waiting_runs_per_tier(client: httpx.AsyncClient, tokens: dict[str, str]) -> None:
    """No worker runs here, so manual runs stay in the queue."""
    admin = auth_as(tokens["admin"])  # only an admin grants priority high
    urgent = await client.post("/jobs", json={**one_off("urgent", "http://127.0.0.1:9/"), "priority": "high"},
                               headers=admin)
    normal = await client.post("/jobs", json=one_off("normal", "http://127.0.0.1:9/"))
    started = time.monotonic()
    for job, count, headers in ((urgent.json()["jobId"], 3, admin), (normal.json()["jobId"], 2, None)):
        for _ in range(count):
            assert (await client.post(f"/jobs/{job}/runs", headers=headers)).status_code == 202
            await asyncio.sleep(0.002)  # manual runs are keyed by the millisecond
    samples = await scrape(client)
    waited = time.monotonic() - started
    assert value(samples, "chimes_queue_depth", tier="high") == 3
    assert value(samples, "chimes_queue_depth", tier="normal") == 2
    assert value(samples, "chimes_queue_depth", tier="batch") == 0
    # The first urgent run was queued before the normal ones, and both within the test's own time.
    oldest = {tier: value(samples, "chimes_queue_oldest_seconds", tier=tier) for tier in ("high", "normal", "batch")}
    assert waited >= oldest["high"] > oldest["normal"] > 0 and oldest["batch"] == 0, (waited, oldest)
    assert value(samples, "chimes_workers_live") == 0


async def test_reaper_requeue_and_lease_changes_are_counted(
    homes: Homes, client: httpx.AsyncClient,
) -> None:
    """A worker that claims a run and vanishes: the reaper hands the run back, and says so."""
    before = await scrape(client)
    job = (await client.post("/jobs", json=one_off("lost", "http://127.0.0.1:9/"))).json()["jobId"]
    assert (await client.post(f"/jobs/{job}/runs")).status_code == 202
    pool = await homes.for_job(job)  # the run's database
    ghost = WorkerStore(pool, "ghost-worker")
    claimed = await ghost.claim(1, lease_sec=0.5, deadline_grace_sec=60)
    assert len(claimed) == 1
    node = SchedulerNode(pool, FAST_SCHEDULER, node_id="reaping-node")
    task = asyncio.create_task(node.run())
    try:
        await wait_for(lambda: node.reaper.reaped >= 1, timeout=20, what="the reaper to hand the run back")
    finally:
        node.stop()
        await task
    after = await scrape(client)
    assert delta(after, before, "chimes_reaper_requeued_total") == 1
    assert delta(after, before, "chimes_run_retries_total", by="reaper") == 1
    assert delta(after, before, "chimes_lease_changes_total", change="gained") == 1024


async def test_made_up_methods_and_random_paths_add_no_series(api_url: str) -> None:
    """Anyone may send anything: unknown methods count as "other", unmatched paths as "unmatched"."""

    words: list[str] = []

    async def flood(http: httpx.AsyncClient) -> None:
        for _ in range(15):
            word = secrets.token_hex(6).upper()
            words.append(word.lower())
            for path in (f"/{word.lower()}", f"/jobs/{word.lower()}/x", f"/ui/static/{word.lower()}.js"):
                await http.request(word, path)
                await http.get(path)
            await http.request(word, "/jobs")  # a route, not this method: 405

    def series(samples: Samples) -> set[frozenset[tuple[str, str]]]:
        return {labels for name, labels in samples if name.startswith("chimes_api_request_duration_seconds")}

    async with httpx.AsyncClient(base_url=api_url, timeout=30) as http:
        await scrape(http)  # a scrape is counted too, once it is answered
        await flood(http)  # the first flood may add the "other" and "unmatched" series once
        first = await scrape(http)
        await flood(http)
        second = await scrape(http)
    assert series(second) == series(first), "new series: " + repr(series(second) - series(first))
    methods = {value for labels in series(second) for key, value in labels if key == "method"}
    routes = {value for labels in series(second) for key, value in labels if key == "route"}
    assert "other" in methods and methods <= {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "other"}
    assert "unmatched" in routes and all(route == "unmatched" or route.startswith("/") for route in routes)
    assert not any(word in route.lower() for word in words for route in routes), "a raw path became a label"
