"""``chimes.client`` against the real API: every endpoint it covers, typed answers, errors that carry
status, code and field, cursors as iterators, If-Match, and rate limits waited out."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from chimes.api.app import create_app
from chimes.api.limits import LimitSettings
from chimes.client import (
    ApiUnreachable,
    AsyncClient,
    Client,
    Conflict,
    InvalidRequest,
    Job,
    JobSpec,
    NotFound,
    PreconditionFailed,
    Unauthorized,
)
from tests.helpers import Homes, free_port
from tests.integration.test_cli_real_api import serve


def definition(name: str, **extra: object) -> dict[str, object]:
    return {"name": name, "schedule": {"cron": "0 2 * * *", "timezone": "Europe/Berlin"},
            "task": {"type": "http", "url": "http://127.0.0.1:9/hook"}, **extra}


@pytest.fixture
async def chimes(api_url: str, tokens: dict[str, str]) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(api_url, tokens["team-a"]) as client:
        yield client


async def test_jobs_round_trip_with_typed_answers(chimes: AsyncClient) -> None:
    spec = JobSpec.model_validate(definition("nightly", timeoutSec=600, tags=["reports"]))
    created = await chimes.jobs.create(spec, idempotency_key="k-1")
    assert created.created and created.version == 1 and created.next_run_at is not None
    again = await chimes.jobs.create(spec, idempotency_key="k-1")
    assert (again.job_id, again.created) == (created.job_id, False)

    job = await chimes.jobs.get(created.job_id)
    assert isinstance(job, Job) and job.owner == "team-a" and job.version == 1
    assert job.name == "nightly" and job.timeout_sec == 600 and job.tags == ["reports"]
    assert job.schedule.cron == "0 2 * * *" and job.next_run_at == created.next_run_at
    assert job.spec().to_wire() == spec.to_wire()
    assert job.raw["jobId"] == created.job_id

    paused = await chimes.jobs.pause(job.job_id)
    assert paused.paused and paused.version == 2
    resumed = await chimes.jobs.resume(job.job_id)
    assert not resumed.paused and resumed.next_run_at is not None

    updated = await chimes.jobs.update(job.job_id, {"timeoutSec": 60}, if_version=resumed.version)
    assert updated.timeout_sec == 60 and updated.version == resumed.version + 1
    with pytest.raises(PreconditionFailed) as stale:  # computed from a version that is gone
        await chimes.jobs.update(job.job_id, {"timeoutSec": 30}, if_version=resumed.version)
    assert stale.value.status == 412 and stale.value.field == "If-Match"
    assert stale.value.current_version == updated.version
    assert (await chimes.jobs.get(job.job_id)).timeout_sec == 60  # nothing changed

    await chimes.jobs.delete(job.job_id, if_version=updated.version)
    with pytest.raises(NotFound) as gone:
        await chimes.jobs.get(job.job_id)
    assert gone.value.status == 404


async def test_cursors_are_iterators_in_both_clients(chimes: AsyncClient, api_url: str,
                                                     tokens: dict[str, str]) -> None:
    ids = [(await chimes.jobs.create(definition(f"job-{n}"))).job_id for n in range(5)]
    assert [job.job_id async for job in chimes.jobs.list(page_size=2)] == ids
    first = await chimes.jobs.page(limit=2)
    assert [j.job_id for j in first.items] == ids[:2] and first.next_cursor

    def blocking() -> tuple[list[str], str]:
        # The API is served by this test's event loop: plain code runs on a thread, as in a script.
        with Client(api_url, tokens["team-a"]) as client:
            listed = [job.job_id for job in client.jobs.list(page_size=2)]
            started = client.jobs.run_now(listed[0])
            return listed, started

    listed, run_id = await asyncio.to_thread(blocking)
    assert listed == ids
    assert [run.run_id async for run in chimes.runs.list(ids[0], page_size=1)] == [run_id]


async def test_runs_now_rerun_cancel_backfill(chimes: AsyncClient) -> None:
    job_id = (await chimes.jobs.create(definition("runs"))).job_id
    run_id = await chimes.jobs.run_now(job_id)
    run = await chimes.runs.get(run_id)
    assert (run.job_id, run.trigger, run.status, run.attempts) == (job_id, "manual", "scheduled", [])
    cancelled = await chimes.runs.cancel(run_id)
    assert cancelled.status == "cancelled"
    with pytest.raises(Conflict) as ended:
        await chimes.runs.cancel(run_id)
    assert ended.value.status == 409
    rerun_id = await chimes.runs.rerun(run_id)
    assert rerun_id != run_id and (await chimes.runs.get(rerun_id)).trigger == "rerun"
    now = datetime.now(UTC).replace(microsecond=0)
    made = await chimes.jobs.backfill(job_id, now - timedelta(days=3), now)
    assert made.created == 3 and len(made.run_ids) == 3
    page = await chimes.runs.page(job_id, status="cancelled")
    assert [r.run_id for r in page.items] == [run_id] and not page.job_deleted


async def test_errors_carry_status_code_field_and_message(chimes: AsyncClient, api_url: str,
                                                          tokens: dict[str, str]) -> None:
    with pytest.raises(InvalidRequest) as bad:
        await chimes.jobs.create(definition("bad", schedule={"cron": "0 2 * * *", "timezone": "Mars/Base"}))
    assert (bad.value.status, bad.value.code, bad.value.field) == (422, "invalid_request", "schedule.timezone")
    assert str(bad.value).startswith("schedule.timezone:")

    other = (await chimes.jobs.create(definition("team-a's"))).job_id
    async with AsyncClient(api_url, tokens["team-b"]) as team_b:
        with pytest.raises(NotFound):
            await team_b.jobs.get(other)
        assert (await team_b.whoami()).owner == "team-b"
    async with AsyncClient(api_url, "chm_not-a-token") as stranger:
        with pytest.raises(Unauthorized) as refused:
            await stranger.jobs.page()
    assert refused.value.status == 401
    async with AsyncClient(f"http://127.0.0.1:{free_port()}", "t") as nowhere:
        with pytest.raises(ApiUnreachable, match="cannot reach the Chimes API"):
            await nowhere.jobs.page()


async def test_whoami_and_notifications(chimes: AsyncClient, api_url: str, tokens: dict[str, str],
                                        homes: Homes) -> None:
    me = await chimes.whoami()
    assert (me.owner, me.scope, me.admin) == ("team-a", "write", False)
    job_id = uuid.uuid4()
    for owner in ("team-a", "team-a", "team-b"):
        await (await homes.for_job(job_id)).execute(
            "INSERT INTO notifications (notification_id, job_id, owner, kind, url, payload) "
            "VALUES ($1, $2, $3, 'run_failed', 'http://127.0.0.1:9/alerts', '{\"runId\": \"r\"}')",
            uuid.uuid4(), job_id, owner)
    mine = [n async for n in chimes.notifications.list(page_size=1)]
    assert [(n.owner, n.kind, n.status, n.payload) for n in mine] == [("team-a", "run_failed", "pending",
                                                                      {"runId": "r"})] * 2
    async with AsyncClient(api_url, tokens["admin"]) as admin:
        assert len([n async for n in admin.notifications.list(job_id=str(job_id))]) == 3
        assert (await admin.whoami()).admin


@pytest.fixture
async def limited_api_url(database_url: str) -> AsyncIterator[str]:
    async for url in serve(create_app(database_url, pool_size=4,
                                      limits=LimitSettings(writes_per_sec=2.0, write_burst=2))):
        yield url


async def test_a_rate_limit_is_waited_out(limited_api_url: str, tokens: dict[str, str]) -> None:
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        await asyncio.sleep(seconds)

    async with AsyncClient(limited_api_url, tokens["team-a"], sleep=sleep) as chimes:
        for n in range(4):
            await chimes.jobs.create(definition(f"job-{n}"))
        assert len([job async for job in chimes.jobs.list()]) == 4
    assert waits and all(0 < wait <= 60 for wait in waits)
