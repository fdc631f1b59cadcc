"""What one team's job holds in the database cannot stop the scheduler or a worker for everyone.

The hostile rows here are written straight into the database, as they were before the API refused
them (or as any future bug might write them): the loops must set them aside and go on.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
from aiohttp import web

from chimes import metrics
from tests.helpers import FailsOnce, Homes, http_server, wait_for
from tests.integration.fleet import Fleet
from tests.integration.test_core_loop import _finished, http_job, run_of, soon
from tests.target import Target


def set_aside(kind: str, role: str = "scheduler") -> float:
    return metrics.ITEMS_SET_ASIDE.labels(role, kind)._value.get()


async def test_a_trigger_with_an_impossible_time_cannot_stop_other_jobs_from_firing(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    before = set_aside("trigger")
    # Year 1 is kept by PostgreSQL as -infinity and read back as a naive datetime: the timer wheel
    # cannot order it. Before 1970 no run id can hold the time. Both stopped fires once.
    for stored in ("-infinity", "1969-12-31T23:59:59Z"):
        job = (await client.post("/jobs", json=http_job(target, "/hostile", {"at": soon(3600)}))).json()
        pool = await homes.for_job(job["jobId"])
        changed = await pool.execute("UPDATE triggers SET fire_at = $2::text::timestamptz WHERE job_id = $1",
                                     uuid.UUID(job["jobId"]), stored)
        assert changed == "UPDATE 1"
    await wait_for(lambda: set_aside("trigger") - before >= 2, timeout=15, what="both triggers set aside")

    once = (await client.post("/jobs", json=http_job(target, "/once", {"at": soon(1)}))).json()
    every = (await client.post("/jobs", json=http_job(target, "/every", {"cron": "* * * * * *"}))).json()
    await wait_for(lambda: _finished(client, once["jobId"]), timeout=15, what="the one-off job of another team")
    await wait_for(lambda: _finished(client, every["jobId"], count=3), timeout=15, what="three fires of the cron job")
    assert target.calls_to("/hostile") == []
    # Set aside once, not tried again on every scan.
    assert set_aside("trigger") - before == 2
    # The node keeps them in the database: nothing is dropped without a trace.
    assert await homes.total("SELECT count(*) FROM triggers t JOIN jobs j USING (job_id) "
                             "WHERE j.task->>'url' LIKE '%/hostile'") == 2


@pytest.fixture
async def nul_target() -> AsyncIterator[str]:
    """A target whose answers hold a NUL byte, which PostgreSQL text cannot keep."""
    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=b"before\x00after")

    async with http_server(handle) as url:
        yield url


async def test_an_answer_postgresql_cannot_store_is_recorded_without_holding_up_other_outcomes(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, nul_target: str
) -> None:
    hostile = (await client.post("/jobs", json={"name": "nul", "schedule": {"at": soon(1)},
                                                "task": {"type": "http", "url": nul_target + "/nul"}})).json()
    healthy = (await client.post("/jobs", json=http_job(target, "/healthy", {"at": soon(1)}))).json()
    [run] = await wait_for(lambda: _finished(client, hostile["jobId"]), timeout=15, what="the NUL answer's run")
    await wait_for(lambda: _finished(client, healthy["jobId"]), timeout=15, what="the healthy run")
    assert run["status"] == "succeeded"
    [attempt] = (await run_of(client, run["runId"]))["attempts"]
    assert attempt["output"] == "before\ufffdafter"


LOOPS = [  # (which store, its method, the role and loop named in chimes_loop_failures_total)
    ("node", "scan_due", "scheduler", "scan"),
    ("node", "sync_leases", "scheduler", "sync_leases"),
    ("worker", "claim", "worker", "claim"),
]


@pytest.mark.parametrize(("owner", "method", "role", "loop"), LOOPS, ids=[f"{o}.{m}" for o, m, _, _ in LOOPS])
async def test_every_loop_goes_on_after_an_unexpected_error(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, owner: str, method: str, role: str, loop: str
) -> None:
    failed = metrics.LOOP_FAILURES.labels(role, loop)
    before = failed._value.get()
    store = fleet.node.store if owner == "node" else fleet.worker.store
    broken = FailsOnce(getattr(store, method), RuntimeError("an error no loop expects"))  # stands for a bug
    setattr(store, method, broken)
    await wait_for(lambda: broken.calls >= 2, timeout=10, what=f"{method} to be called again after the error")
    assert failed._value.get() - before == 1
    job = (await client.post("/jobs", json=http_job(target, "/after", {"at": soon(1)}))).json()
    await wait_for(lambda: _finished(client, job["jobId"]), timeout=15, what="a run after the error")
    assert len(target.calls_to("/after")) == 1
