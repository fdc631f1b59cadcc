"""Roles keep going through every error a PostgreSQL restart can surface (found by `chimes chaos`).

When the server shuts down while a pooled connection is mid-operation, asyncpg can hand that
connection out again and fail the next call with ``InternalClientError`` ("cannot switch to state
15; another operation (2) is in progress", MagicStack/asyncpg#784), which is neither a
``PostgresError`` nor an ``InterfaceError``. A chaos run saw two workers exit on it during a fast
restart. That race cannot be produced on demand, so these tests make one store call raise the error
exactly as asyncpg does; the fleet, the database and the target are real.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx

from tests.helpers import wait_for
from tests.integration.fleet import Fleet
from tests.target import Target


class FailsOnce:
    """Wraps a store method: the first call raises asyncpg's InternalClientError, later calls go through."""

    def __init__(self, method: Callable[..., Awaitable[Any]]) -> None:
        self.method = method
        self.calls = 0

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            raise asyncpg.InternalClientError("cannot switch to state 15; another operation (2) is in progress")
        return await self.method(*args, **kwargs)


async def one_off(client: httpx.AsyncClient, target: Target, path: str) -> str:
    at = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    response = await client.post("/jobs", json={"name": path.strip("/"), "schedule": {"at": at},
                                                "task": {"type": "http", "url": target.url + path}})
    assert response.status_code == 201, response.text
    return response.json()["jobId"]


async def succeeded(client: httpx.AsyncClient, job_id: str) -> bool:
    runs = (await client.get(f"/jobs/{job_id}/runs")).json()["runs"]
    return bool(runs) and runs[0]["status"] == "succeeded"


async def test_worker_keeps_claiming_after_asyncpg_fails_a_broken_connection(
    fleet: Fleet, client: httpx.AsyncClient, target: Target
) -> None:
    broken = FailsOnce(fleet.worker.store.claim)
    fleet.worker.store.claim = broken  # type: ignore[method-assign]
    await wait_for(lambda: broken.calls >= 1, timeout=10, what="the worker to hit the broken connection")
    job_id = await one_off(client, target, "/after-claim-error")
    await wait_for(lambda: succeeded(client, job_id), timeout=15, what="the worker to run the job anyway")
    assert len(target.calls_to("/after-claim-error")) == 1


async def test_scheduler_keeps_scanning_after_asyncpg_fails_a_broken_connection(
    fleet: Fleet, client: httpx.AsyncClient, target: Target
) -> None:
    broken = FailsOnce(fleet.node.store.scan_due)
    fleet.node.store.scan_due = broken  # type: ignore[method-assign]
    await wait_for(lambda: broken.calls >= 1, timeout=10, what="the node to hit the broken connection")
    job_id = await one_off(client, target, "/after-scan-error")
    await wait_for(lambda: succeeded(client, job_id), timeout=15, what="the node to fire the job anyway")
    assert len(target.calls_to("/after-scan-error")) == 1
