"""Roles keep going through every error a PostgreSQL restart can surface (found by `chimes chaos`).

When the server shuts down while a pooled connection is mid-operation, asyncpg can hand that
connection out again and fail the next call with ``InternalClientError`` ("cannot switch to state
15; another operation (2) is in progress", MagicStack/asyncpg#784), which is neither a
``PostgresError`` nor an ``InterfaceError``. A chaos run saw two workers exit on it during a fast
restart. That race cannot be produced on demand, so these tests make one store call raise the error
exactly as asyncpg does; the fleet, the database and the target are real.

A restart also drops each worker's LISTEN connection; a worker must listen again once the server is
back, not poll for the rest of its life (every run would then start up to a poll interval late). Its
backend is ended with ``pg_terminate_backend``, as a restart ends it.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx
import pytest

from chimes.worker.worker import Worker
from chimes_chaos import observer
from tests.helpers import FailsOnce, Homes, wait_for
from tests.integration.fleet import FAST_WORKER, Fleet
from tests.target import Target


def broken_connection() -> Exception:
    return asyncpg.InternalClientError("cannot switch to state 15; another operation (2) is in progress")


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
    broken = FailsOnce(fleet.worker.store.claim, broken_connection())
    fleet.worker.store.claim = broken  # type: ignore[method-assign]
    await wait_for(lambda: broken.calls >= 1, timeout=10, what="the worker to hit the broken connection")
    job_id = await one_off(client, target, "/after-claim-error")
    await wait_for(lambda: succeeded(client, job_id), timeout=15, what="the worker to run the job anyway")
    assert len(target.calls_to("/after-claim-error")) == 1


async def test_worker_keeps_claiming_after_its_claims_connection_is_ended(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    """Each claim loop claims on a connection of its own (open_claims_pool); ended by the server, as a
    restart ends it, it is replaced at the next claim."""
    for home, worker in zip(await homes.homes(), fleet.workers, strict=True):
        claims = await wait_for(lambda w=worker: w.store.claims, timeout=10, what="the claims connection")
        async with claims.acquire() as conn:
            backend = conn.get_server_pid()
        assert await home.fetchval("SELECT pg_terminate_backend($1)", backend)
    job_id = await one_off(client, target, "/after-claims-ended")
    await wait_for(lambda: succeeded(client, job_id), timeout=15, what="the worker to run the job anyway")
    assert len(target.calls_to("/after-claims-ended")) == 1


async def test_scheduler_keeps_scanning_after_asyncpg_fails_a_broken_connection(
    fleet: Fleet, client: httpx.AsyncClient, target: Target
) -> None:
    broken = FailsOnce(fleet.node.store.scan_due, broken_connection())
    fleet.node.store.scan_due = broken  # type: ignore[method-assign]
    await wait_for(lambda: broken.calls >= 1, timeout=10, what="the node to hit the broken connection")
    job_id = await one_off(client, target, "/after-scan-error")
    await wait_for(lambda: succeeded(client, job_id), timeout=15, what="the node to fire the job anyway")
    assert len(target.calls_to("/after-scan-error")) == 1


async def listening_backend(pool: asyncpg.Pool) -> int | None:
    return await pool.fetchval("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                               "AND query LIKE 'LISTEN %'")


async def test_worker_listens_again_after_its_listen_connection_is_dropped(
    pool: asyncpg.Pool, database_url: str, client: httpx.AsyncClient, target: Target
) -> None:
    # Polling once a minute: a run started within seconds was woken by NOTIFY.
    worker = Worker(pool, database_url, replace(FAST_WORKER, poll_every_sec=60.0), worker_id="listener")
    running = asyncio.create_task(worker.run())
    try:
        first = await wait_for(lambda: listening_backend(pool), timeout=10, what="the worker to LISTEN")
        assert await pool.fetchval("SELECT pg_terminate_backend($1)", first)
        second = await wait_for(lambda: _other_backend(pool, first), timeout=10, what="the worker to LISTEN again")
        assert second != first and worker.listening

        response = await client.post("/jobs", json={"name": "woken", "schedule": {"cron": "0 0 1 1 *"},
                                                    "task": {"type": "http", "url": target.url + "/woken"}})
        assert response.status_code == 201, response.text
        job_id = response.json()["jobId"]
        assert (await client.post(f"/jobs/{job_id}/runs")).status_code == 202
        await wait_for(lambda: succeeded(client, job_id), timeout=10, what="NOTIFY to wake the worker")
        assert len(target.calls_to("/woken")) == 1
    finally:
        worker.stop()
        await running


async def _other_backend(pool: asyncpg.Pool, old: int) -> int | None:
    pid = await listening_backend(pool)
    return pid if pid not in (None, old) else None


async def test_chaos_lease_observer_keeps_watching_after_asyncpg_fails_a_broken_connection(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It once ended a 30-minute chaos run with this error, before any invariant was checked.
    real_connect = asyncpg.connect
    opened: list[asyncpg.Connection] = []

    class FirstConnection:
        """A real connection whose first fetch fails as asyncpg's does (its attributes are read-only)."""

        def __init__(self, conn: asyncpg.Connection) -> None:
            self.conn, self.fetch = conn, FailsOnce(conn.fetch, broken_connection())

        def __getattr__(self, name: str) -> Any:
            return getattr(self.conn, name)

    async def connect(*args: Any, **kwargs: Any) -> Any:
        conn = await real_connect(*args, **kwargs)
        opened.append(conn)
        return FirstConnection(conn) if len(opened) == 1 else conn

    monkeypatch.setattr(observer.asyncpg, "connect", connect)
    watcher = observer.LeaseObserver(database_url, every_sec=0.05)
    stop = asyncio.Event()
    watching = asyncio.create_task(watcher.run(stop))
    try:
        await wait_for(lambda: watcher.polls >= 3, timeout=10, what="the observer to poll again")
    finally:
        stop.set()
        await watching
    assert watcher.failed_polls == 1
    assert len(opened) == 2 and opened[0].is_closed()  # the broken connection was dropped, a new one opened
