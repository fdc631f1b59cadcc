"""Edits, pauses and resumes never cost a slot its record: every slot of an every-second job has one
run record (ran, or skipped with its reason) however often, and whenever, the job is changed.

A real scheduler node and worker (tests/integration/fleet.py) fire the jobs; the edits go through the
API at random instants, so that some land while a slot is due and not yet fired.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx
import pytest

from chimes.scheduler.node import SchedulerNode
from tests.helpers import Homes, wait_for
from tests.integration.fleet import FAST_SCHEDULER, Fleet
from tests.integration.test_core_loop import http_job
from tests.target import Target

EDITING_SEC = 15.0

Edit = Callable[[int], Awaitable[httpx.Response]]


async def _slot_records(pool: asyncpg.Pool, job_id: str, first: datetime, last: datetime) -> dict[datetime, int]:
    rows = await pool.fetch("SELECT scheduled_at, count(*) AS records FROM runs WHERE job_id = $1 "
                            "AND scheduled_at BETWEEN $2 AND $3 AND trigger IN ('schedule', 'catchup') "
                            "GROUP BY scheduled_at", uuid.UUID(job_id), first, last)
    return {r["scheduled_at"]: r["records"] for r in rows}


def _whole_second_after(moment: datetime) -> datetime:
    return moment.replace(microsecond=0) + timedelta(seconds=1)


async def _keep_editing(edit: Edit, until: float, rng: random.Random) -> int:
    edits = 0
    loop = asyncio.get_running_loop()
    while loop.time() < until:
        response = await edit(edits)
        assert response.status_code == 200, response.text
        edits += 1
        await asyncio.sleep(rng.uniform(0.2, 0.7))  # a random instant within the second, again and again
    return edits


@pytest.mark.long  # every-second jobs edited at random instants for seconds
async def test_edits_at_random_instants_leave_one_record_per_slot(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    """Every-second jobs (concurrency allow): one edited only in its tags (a GitOps loop), one in what
    the scheduler reads (its catch-up policy and start deadline, by turns), one paused and resumed by
    turns, and one left alone. Over the whole time, each has exactly one record for every slot."""
    schedule = {"cron": "* * * * * *"}
    names = ("tags", "plan", "pauses", "untouched")
    jobs = {}
    for name in names:
        created = await client.post("/jobs", json=http_job(target, f"/{name}", schedule, concurrency="allow"))
        assert created.status_code == 201, created.text
        jobs[name] = created.json()["jobId"]

    async def tags(n: int) -> httpx.Response:
        return await client.patch(f"/jobs/{jobs['tags']}", json={"tags": [f"edit-{n}"]})

    async def plan(n: int) -> httpx.Response:
        return await client.patch(f"/jobs/{jobs['plan']}", json={
            "catchUp": {"policy": "all" if n % 2 else "one"}, "startDeadlineSec": 60 + n % 7})

    async def pauses(n: int) -> httpx.Response:
        return await client.patch(f"/jobs/{jobs['pauses']}", json={"paused": n % 2 == 0})

    rng = random.Random(59)
    loop = asyncio.get_running_loop()
    started = datetime.now(UTC)
    until = loop.time() + EDITING_SEC
    counts = await asyncio.gather(*(_keep_editing(edit, until, random.Random(rng.random()))
                                    for edit in (tags, plan, pauses)))
    stopped = datetime.now(UTC)
    last_pause = counts[2] - 1
    if last_pause % 2 == 0:  # the loop ended on a pause: resume, so that the paused slots are recorded
        assert (await pauses(last_pause + 1)).status_code == 200
    assert min(counts) >= EDITING_SEC / 0.7 - 1

    first, last = _whole_second_after(started), stopped.replace(microsecond=0)
    slots = int((last - first).total_seconds()) + 1
    for name, job_id in jobs.items():
        pool = await homes.for_job(job_id)
        await wait_for(lambda p=pool, j=job_id: _fired_beyond(p, j, last), timeout=20,
                       what=f"{name}'s slots after the edits")
        records = await _slot_records(pool, job_id, first, last)
        missing = sorted(first + timedelta(seconds=s) for s in range(slots)
                         if first + timedelta(seconds=s) not in records)
        assert missing == [], f"{name}: {len(missing)} of {slots} slots have no record, the first {missing[:3]}"
        assert set(records.values()) == {1}, f"{name}: a slot recorded twice"


async def _fired_beyond(pool: asyncpg.Pool, job_id: str, last: datetime) -> bool:
    newest = await pool.fetchval("SELECT max(scheduled_at) FROM runs WHERE job_id = $1", uuid.UUID(job_id))
    return newest is not None and newest > last + timedelta(seconds=1)


async def test_a_schedule_edit_keeps_the_old_slot_that_was_due_and_starts_the_new_after_it(
    client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    """No scheduler runs: the every-minute job's slot comes due and stays unfired. An edit to run
    hourly keeps that slot (the old definition's, fired late once by whoever fires next) and starts
    the new schedule after the edit; the job shows the kept slot as its next run."""
    created = await client.post("/jobs", json=http_job(target, "/minutely", {"cron": "* * * * *"}))
    job_id = created.json()["jobId"]
    pool = await homes.for_job(job_id)
    due_at = await pool.fetchval("UPDATE triggers SET fire_at = date_trunc('minute', now()) - interval '1 minute' "
                                 "WHERE job_id = $1 RETURNING fire_at", uuid.UUID(job_id))
    edited = await client.patch(f"/jobs/{job_id}", json={"schedule": {"cron": "0 * * * *"}})
    assert edited.status_code == 200, edited.text
    assert datetime.fromisoformat(edited.json()["nextRunAt"]) == due_at
    triggers = await pool.fetch("SELECT fire_at FROM triggers WHERE job_id = $1 ORDER BY fire_at", uuid.UUID(job_id))
    new_first = triggers[1]["fire_at"]
    assert [t["fire_at"] for t in triggers] == [due_at, new_first]
    assert new_first.minute == 0 and new_first > datetime.now(UTC)
    carried = await pool.fetchrow("SELECT carried_slots, carried_until FROM jobs WHERE job_id = $1", uuid.UUID(job_id))
    # The old definition's slots up to the edit: the one due, and the next if a minute turned meanwhile.
    assert carried["carried_slots"][0] == due_at and carried["carried_until"] < new_first


async def test_a_node_reads_a_trigger_an_edit_kept_again_at_once(
    pool: asyncpg.Pool, client: httpx.AsyncClient, target: Target
) -> None:
    """The node holds a due trigger at version 1; an edit keeps it for its slot at version 2, so the
    batch the node sends fires nothing. The node reads it again at once and fires it then, not at its
    next scan (a second on, after the slot that follows, which concurrency skip would then skip)."""
    created = await client.post("/jobs", json=http_job(target, "/kept", {"cron": "0 0 1 1 *"}))
    job_id = uuid.UUID(created.json()["jobId"])
    node = SchedulerNode(pool, FAST_SCHEDULER, node_id="holding")
    await node.leases.sync()
    due_at = await pool.fetchval("UPDATE triggers SET fire_at = date_trunc('second', clock_timestamp()) "
                                 "WHERE job_id = $1 RETURNING fire_at", job_id)
    [held] = await node.store.scan_due(list(node.leases.held), due_at + timedelta(seconds=1), 10)
    assert node.wheel.add(held)
    await pool.execute("UPDATE triggers SET job_version = 2 WHERE job_id = $1", job_id)  # as an edit keeping it
    await pool.execute("UPDATE jobs SET version = 2 WHERE job_id = $1", job_id)
    await node._fire_batch(node.wheel.pop_due(due_at.timestamp() + 1))
    assert not await pool.fetchval("SELECT count(*) FROM runs WHERE job_id = $1", job_id)
    [again] = node.wheel.pop_due(due_at.timestamp() + 1)  # held again without a scan
    assert (again.fire_at, again.job_version) == (due_at, 2)
    await node._fire_batch([again])
    assert await pool.fetchval("SELECT scheduled_at FROM runs WHERE job_id = $1", job_id) == due_at
    await node.leases.release_all()
