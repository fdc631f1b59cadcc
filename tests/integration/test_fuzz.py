"""Property-based fuzzing of the live API from its own OpenAPI document, with schemathesis: valid and
invalid requests to every operation must never get a 5xx, and every answer must match the document
(status code, content type, body schema). Bounded in examples and in time, for CI.

It runs the schemathesis command line in a child process, so the API under test keeps serving in
this test's event loop meanwhile.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import asyncpg
import httpx
import pytest

from chimes.api.app import create_app
from chimes.api.limits import LimitSettings
from tests.helpers import auth_as
from tests.integration.served import served

pytestmark = pytest.mark.long  # generated requests against the whole API

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
MAX_EXAMPLES = 15
TIME_BUDGET_SEC = 30


async def test_the_api_answers_every_generated_request_within_its_document(
    database_url: str, pool: asyncpg.Pool, tokens: dict[str, str], tmp_path: Path
) -> None:
    # No rate limit in the way of the fuzzer (it is tested on its own), and a quota that holds.
    limits = LimitSettings(write_burst=100_000, writes_per_sec=10_000.0, auth_failure_burst=100_000,
                           default_job_quota=1_000)
    async with served(create_app(database_url, pool_size=4, limits=limits)) as url:
        async with httpx.AsyncClient(base_url=url, headers=auth_as(tokens["team-a"])) as http:
            # Something to find: a job and a run, so that operations on ids get past 404 sometimes.
            job = await http.post("/jobs", json={"name": "seed", "schedule": {"cron": "0 2 * * *"},
                                                 "task": {"type": "http", "url": "http://127.0.0.1:9/"}})
            await http.post(f"/jobs/{job.json()['jobId']}/runs")
        st = Path(sys.executable).with_name("st")
        process = await asyncio.create_subprocess_exec(
            str(st), "run", f"{url}/openapi.json", "--checks", CHECKS,
            "--header", f"Authorization: Bearer {tokens['admin']}",  # admin: every operation is reachable
            "--max-examples", str(MAX_EXAMPLES), "--max-time", str(TIME_BUDGET_SEC), "--seed", "20261130",
            "--phases", "examples,fuzzing", "--workers", "2", "--request-timeout", "20",
            "--generation-database", "none", "--no-color", "--output-truncate", "true",
            cwd=tmp_path, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await asyncio.wait_for(process.communicate(), timeout=TIME_BUDGET_SEC + 45)
    report = output.decode(errors="replace")
    assert process.returncode == 0, report[-8000:]
    assert "No issues found" in report or " passed" in report, report[-4000:]
