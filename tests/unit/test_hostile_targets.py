"""Targets that misbehave, one thing each (tests/hostile.py, a listener in a process of its own),
called through the HTTP tasks' executor as a worker calls them. For each: the run's outcome is true
(a failure names what the target did), the calling process's memory grows by less than
:data:`MEMORY_BOUND` while the target sends what it sends (an endless body, a gigabyte of zeros in
gzip, an endless header), and another owner's calls through the same executor keep being answered on
time meanwhile. tests/integration/test_hostile_targets.py drives the same targets through a worker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest

from chimes.worker.tasks.common import Outcome, TaskContext
from chimes.worker.tasks.http import HttpExecutor
from tests.helpers import wait_for
from tests.hostile import ROWS, HostileTarget, MemoryWatch, Row, hostile_target

#: How much the calling process may grow while it calls one hostile target: libcurl's buffers and the
#: output tail are what a reply may cost, whatever the target sends.
MEMORY_BOUND = 32 * 1024 * 1024
#: The latest another owner's call may end after it was due, while the hostile call runs.
OTHER_OWNER_LATE_SEC = 0.5


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileTarget]:
    with hostile_target() as target:
        yield target


def ctx(owner: str, run: int = 1, timeout_sec: float = 20.0) -> TaskContext:
    return TaskContext(f"run-{run}", "job-1", 1, datetime(2026, 12, 1, tzinfo=UTC), timeout_sec, owner=owner)


@dataclass
class OtherOwner:
    """Another owner's calls through the same executor, one due every 50 ms: how late each ended."""

    executor: HttpExecutor
    url: str
    late: list[float] = field(default_factory=list)
    failed: list[Outcome] = field(default_factory=list)

    async def keep_calling(self) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        for n in range(1_000_000):
            due = started + 0.05 * n
            await asyncio.sleep(max(0.0, due - loop.time()))
            outcome = await self.executor.run({"type": "http", "url": self.url}, ctx("other", n))
            self.late.append(loop.time() - due)
            if not outcome.succeeded:
                self.failed.append(outcome)


@pytest.fixture
async def executor() -> AsyncIterator[HttpExecutor]:
    http = HttpExecutor(max_connections=10)
    try:
        yield http
    finally:
        await http.close()


async def _call(executor: HttpExecutor, url: str, method: str, body: str | None, run: int) -> Outcome:
    task: dict[str, Any] = {"type": "http", "method": method, "url": url, **({"body": body} if body else {})}
    return await executor.run(task, ctx("hostile", run))


@pytest.mark.parametrize("row", list(ROWS.values()), ids=list(ROWS))
async def test_a_hostile_target_gets_a_true_outcome_within_the_workers_bounds(
    hostile: HostileTarget, executor: HttpExecutor, row: Row
) -> None:
    other = OtherOwner(executor, f"{hostile.url}/healthy")
    asked_before = len(hostile.asked())
    await executor.run({"type": "http", "url": f"{hostile.url}/healthy"}, ctx("other"))  # its pool, warm
    watch = MemoryWatch()
    calling = asyncio.create_task(other.keep_calling())
    try:
        outcome = await asyncio.wait_for(_call(executor, hostile.url + row.path, row.method, row.body, 1), 30)
        then = None
        if row.then is not None:
            method, path, _ = row.then
            then = await asyncio.wait_for(_call(executor, hostile.url + path, method, None, 2), 30)
        ended = len(other.late)
        await wait_for(lambda: len(other.late) >= ended + 3, timeout=10, what="the other owner's next calls")
    finally:
        calling.cancel()
        grown = watch.stop()
    asked = hostile.asked()[asked_before:]

    if row.succeeded:
        assert outcome.succeeded, outcome.error
        assert row.said in (outcome.output or ""), outcome.output
    else:
        assert not outcome.succeeded and outcome.error is not None, outcome
        assert row.said in outcome.error, outcome.error
    if row.then is not None:
        assert then is not None and then.succeeded and then.output == row.then[2], (
            "the next call on the owner's pool read its own reply", then)
    assert asked.count(row.path) == row.asked, asked
    assert "/trap" not in asked and "?" not in asked, asked
    assert grown < MEMORY_BOUND, f"the process grew by {grown / 2**20:.1f} MiB"
    assert other.failed == [] and len(other.late) >= 3, (other.failed, other.late)
    assert max(other.late) < OTHER_OWNER_LATE_SEC, f"another owner's call ended {max(other.late):.2f} s late"


async def test_user_info_in_the_url_is_never_sent_and_fails_the_run_saying_how_to_pass_credentials(
    hostile: HostileTarget, executor: HttpExecutor
) -> None:
    """Only a row written around the API can hold such a URL (the API refuses it): its credentials
    would otherwise sit in the job in plain text. The run's error does not repeat them."""
    asked_before = len(hostile.asked())
    url = hostile.url.replace("://", "://user:s3cret@") + "/trap"
    outcome = await _call(executor, url, "GET", None, 1)
    assert not outcome.succeeded and outcome.error is not None
    assert outcome.error.startswith("cannot call a URL with user info: the URL carries user info"), outcome.error
    assert "task.secretHeaders" in outcome.error and "s3cret" not in outcome.error
    assert hostile.asked()[asked_before:] == []
