"""The hostile targets of tests/hostile.py through a worker: team A's one-off jobs call each at once,
team B's every-second job calls a healthy target meanwhile. Each of A's runs records a true outcome
(a failure names what the target did), B's runs keep starting on time, and the process that runs
the worker (this one: the fleet runs in the test's loop) grows by less than :data:`MEMORY_BOUND`.
The same matrix, call by call through the executor, is tests/unit/test_hostile_targets.py."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from tests.helpers import Homes, auth_as, wait_for
from tests.hostile import ROWS, MemoryWatch, Row, hostile_target
from tests.integration.fleet import Fleet
from tests.target import Target

pytestmark = pytest.mark.long  # a worker facing every hostile target in turn

#: How much the worker's process may grow while its runs call every hostile target at once.
MEMORY_BOUND = 32 * 1024 * 1024
#: The latest team B's every-second run may start after its second.
START_LATE_SEC = 1.5
TIMEOUT_SEC = 20
#: Every case but the large upload's: its 8 MiB body is the task's own (what the worker reads and
#: sends), not what the target makes it hold; tests/unit/test_hostile_targets.py has that case.
CASES = {case: row for case, row in ROWS.items() if row.body is None}


def _one_off(name: str, url: str, at: datetime, row: Row | None = None, method: str = "GET") -> dict[str, Any]:
    task: dict[str, Any] = {"type": "http", "method": row.method if row else method, "url": url}
    return {"name": name, "schedule": {"at": at.isoformat()}, "task": task, "timeoutSec": TIMEOUT_SEC,
            "retryPolicy": {"maxAttempts": 1}}


async def _ended(homes: Homes, owner: str, count: int) -> bool:
    done = await homes.total("SELECT count(*) FROM runs WHERE owner = $1 AND status IN ('succeeded', 'failed')",
                             owner)
    return done >= count


async def test_a_worker_facing_hostile_targets_records_true_outcomes_and_keeps_another_owners_runs_on_time(
    fleet: Fleet, client: httpx.AsyncClient, tokens: dict[str, str], homes: Homes, target: Target
) -> None:
    team_b = auth_as(tokens["team-b"])
    steady = await client.post("/jobs", headers=team_b, json={
        "name": "steady", "schedule": {"everySec": 1}, "concurrency": "allow",
        "task": {"type": "http", "method": "GET", "url": f"{target.url}/steady"}})
    assert steady.status_code == 201, steady.text
    await wait_for(lambda: len(target.calls_to("/steady")) >= 2, timeout=15, what="team B's runs to start")

    with hostile_target() as hostile:
        at = datetime.now(UTC) + timedelta(seconds=3)
        jobs: dict[str, str] = {}  # job id -> case
        for case, row in CASES.items():
            made = await client.post("/jobs", json=_one_off(case, hostile.url + row.path, at, row))
            assert made.status_code == 201, made.text
            jobs[made.json()["jobId"]] = case
        then_at = at + timedelta(seconds=TIMEOUT_SEC / 2)  # after every hostile run ended, on team A's pool
        follow_ups: dict[str, str] = {}
        for case, row in CASES.items():
            if row.then is not None:
                method, path, _ = row.then
                made = await client.post("/jobs", json=_one_off(f"after {case}", hostile.url + path, then_at,
                                                                method=method))
                assert made.status_code == 201, made.text
                follow_ups[made.json()["jobId"]] = case
        user_info = await client.post("/jobs", json=_one_off("user info", hostile.url, at))
        assert user_info.status_code == 201, user_info.text
        await (await homes.for_job(user_info.json()["jobId"])).execute(
            "UPDATE jobs SET task = jsonb_set(task, '{url}', to_jsonb($1::text)) WHERE job_id = $2",
            hostile.url.replace("://", "://user:s3cret@") + "/trap", uuid.UUID(user_info.json()["jobId"]))

        watch = MemoryWatch()
        try:
            await wait_for(lambda: _ended(homes, "team-a", len(jobs) + len(follow_ups) + 1),
                           timeout=TIMEOUT_SEC * 3, what="every run of team A to end")
        finally:
            grown = watch.stop()
        asked = hostile.asked()
    window_end = datetime.now(UTC)

    runs = {str(r["job_id"]): r for r in await homes.fetch(  # a long output is kept on the attempt
        "SELECT job_id, status, error, coalesce(output, (SELECT a.output FROM run_attempts a WHERE a.run_id = "
        "r.run_id ORDER BY a.attempt DESC LIMIT 1)) AS output FROM runs r WHERE owner = 'team-a'")}
    for job_id, case in jobs.items():
        row, run = ROWS[case], runs[job_id]
        if row.succeeded:
            assert run["status"] == "succeeded", (case, run["error"])
            assert row.said in (run["output"] or ""), (case, run["output"])
        else:
            assert run["status"] == "failed", (case, run["output"])
            assert row.said in (run["error"] or ""), (case, run["error"])
    for job_id, case in follow_ups.items():
        then = ROWS[case].then
        assert then is not None
        run = runs[job_id]
        assert (run["status"], run["output"]) == ("succeeded", then[2]), (case, run["error"], run["output"])
    refused = runs[user_info.json()["jobId"]]
    assert refused["status"] == "failed" and "user info" in refused["error"] and "s3cret" not in refused["error"]
    assert "/trap" not in asked and "?" not in asked, asked
    assert asked.count("/redirect-loop") == ROWS["redirect loop"].asked

    assert grown < MEMORY_BOUND, f"the worker's process grew by {grown / 2**20:.1f} MiB"
    starts = await homes.fetch("SELECT scheduled_at, started_at FROM runs WHERE owner = 'team-b' "
                               "AND scheduled_at BETWEEN $1 AND $2", at - timedelta(seconds=1), window_end)
    assert len(starts) >= 5, starts
    late = [(r["started_at"] - r["scheduled_at"]).total_seconds() for r in starts if r["started_at"] is not None]
    assert len(late) >= len(starts) - 1, "team B's runs started (the last may be on its way)"
    assert max(late) < START_LATE_SEC, f"team B's runs started up to {max(late):.2f} s after their second"
