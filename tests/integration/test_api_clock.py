"""The API reads "now" from the clock it is given, not from the host's.

A job's first fire time and whether a backfill's end is still in the past are the API's own decisions,
taken by its clock (chimes.api.clock). Here the API runs on a clock two days behind the host's: a job
it creates fires by that clock, and a backfill ending an hour ago by the host's clock is, by the API's,
still in the future and refused.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg
import httpx

from chimes.api.app import create_app
from chimes.clock import Clock
from tests.helpers import auth_as
from tests.integration.served import served
from tests.integration.test_jobs_api import HTTP_TASK

BEHIND = timedelta(days=2)


async def test_the_api_decides_by_its_clock_not_the_hosts(database_url: str, pool: asyncpg.Pool,
                                                          tokens: dict[str, str]) -> None:
    clock = Clock(offset_sec=-BEHIND.total_seconds())
    async with served(create_app(database_url, pool_size=2, clock=clock)) as url, \
            httpx.AsyncClient(base_url=url, headers=auth_as(tokens["team-a"]), timeout=30) as http:
        before = clock.now()
        created = await http.post("/jobs", json={"name": "hourly", "schedule": {"cron": "0 * * * *", "timezone": "UTC"},
                                                 "task": HTTP_TASK})
        after = clock.now()
        assert created.status_code == 201, created.text
        next_run = datetime.fromisoformat(created.json()["nextRunAt"])
        # The next full hour after the API's "now", two days before the host's.
        assert before < next_run <= after.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
        assert next_run < datetime.now(UTC) - BEHIND + timedelta(hours=1)
        job_id = created.json()["jobId"]

        host_past = datetime.now(UTC) - timedelta(hours=1)
        refused = await http.post(f"/jobs/{job_id}/backfill", json={
            "start": (host_past - timedelta(hours=3)).isoformat(), "end": host_past.isoformat()})
        assert refused.status_code == 422, refused.text
        assert refused.json()["field"] == "end" and "covers the past" in refused.json()["message"]

        api_past = clock.now() - timedelta(hours=1)
        accepted = await http.post(f"/jobs/{job_id}/backfill", json={
            "start": (api_past - timedelta(hours=3)).isoformat(), "end": api_past.isoformat()})
        assert accepted.status_code == 202, accepted.text
        assert accepted.json()["created"] == 3
