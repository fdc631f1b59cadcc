"""`chimes shards move` on a live fleet: a range of partitions, with its jobs, triggers and run history,
goes from the catalog to a new database while a `chimes scheduler` fires every-second jobs in it, a
`chimes worker` runs them, and the API takes writes (docs/scaling.md, "Moving partitions").

Each test checks the move's invariants: every job of the range lives on the target alone, with its
whole history; one run per slot and no slot missing, before, during and after the move; no run
fired early; every job written during the move is where the map says; the API answered every write.
The kill tests stop the mover at each phase (CHIMES_MOVE_STOP_AT), SIGKILL it with the scheduler and
the worker, start new ones, and resume the move; another cuts the mover's session with the source."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx
import pytest

from chimes.ids import partition_of, partition_of_key
from chimes.moves import STOP_POINTS
from chimes.store import db
from chimes.store.moves import MOVER_GONE_AFTER_SEC
from chimes.store.working import Completion, WorkerStore
from chimes.worker.tasks.common import Outcome
from tests.conftest import scratch_database
from tests.e2e.processes import ChimesProcess, Processes
from tests.helpers import wait_for
from tests.target import Target

pytestmark = [pytest.mark.own_shard_map,  # a catalog and a shard of its own, whatever --shards says
              pytest.mark.sharded_pass]  # long: in the second pass, scripts/test --sharded

MOVED = (512, 1023)  # the range that moves; 0-511 stay in the catalog
EVERY_SECOND = {"schedule": {"cron": "* * * * * *"}, "concurrency": "allow"}


@pytest.fixture
async def shard_url(second_server_dsn: str) -> AsyncIterator[str]:
    async with scratch_database(second_server_dsn, "chimes_e2e_move_target") as dsn:
        yield dsn


def keys_in(first: int, last: int, count: int, prefix: str) -> list[str]:
    keys = (f"{prefix}-{i}" for i in range(100_000))
    return [k for k in keys if first <= partition_of_key("team-a", k) <= last][:count]


async def create(client: httpx.AsyncClient, target: Target, name: str, key: str) -> uuid.UUID:
    body = {"name": name, **EVERY_SECOND, "task": {"type": "http", "url": f"{target.url}/{name}"}}
    created = await client.post("/jobs", json=body, headers={"Idempotency-Key": key})
    assert created.status_code in (200, 201), created.text
    return uuid.UUID(created.json()["jobId"])


async def jobs_on_both_sides(client: httpx.AsyncClient, target: Target) -> tuple[list[uuid.UUID], list[uuid.UUID]]:
    """Three jobs that stay and six that move. With one database the API picks job ids at random:
    jobs are created until each side has its share, the extra ones deleted."""
    kept: list[uuid.UUID] = []
    moving: list[uuid.UUID] = []
    for attempt in range(60):
        job_id = await create(client, target, "spare", f"spare-{attempt}")
        side, name = (moving, "moving") if partition_of(job_id) >= MOVED[0] else (kept, "kept")
        if len(side) < (6 if side is moving else 3):
            renamed = await client.patch(f"/jobs/{job_id}", json={"name": f"{name}-{len(side)}", "task": {
                "type": "http", "url": f"{target.url}/{name}-{len(side)}"}})
            assert renamed.status_code == 200, renamed.text
            side.append(job_id)
        else:
            assert (await client.delete(f"/jobs/{job_id}")).status_code == 204
        if len(kept) == 3 and len(moving) == 6:
            return kept, moving
    raise AssertionError("60 random job ids, and not three on one side and six on the other")


async def job_homes(catalog_url: str, shard_url: str) -> tuple[set[uuid.UUID], set[uuid.UUID]]:
    found = []
    for url in (catalog_url, shard_url):
        conn = await asyncpg.connect(url)
        try:
            found.append({r["job_id"] for r in await conn.fetch("SELECT job_id FROM jobs")})
        finally:
            await conn.close()
    return found[0], found[1]


async def schedule_runs(url: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(url)
    try:
        return list(await conn.fetch("SELECT job_id, run_id, scheduled_at, status, fired_at FROM runs "
                                     "WHERE trigger IN ('schedule', 'catchup') ORDER BY job_id, scheduled_at"))
    finally:
        await conn.close()


def check_slots(runs: list[asyncpg.Record], jobs: set[uuid.UUID]) -> None:
    """One run per slot, no second missing between a job's first and last, none fired early."""
    by_job: dict[uuid.UUID, list[asyncpg.Record]] = {}
    for run in runs:
        by_job.setdefault(run["job_id"], []).append(run)
    for job_id in jobs:
        slots = [r["scheduled_at"] for r in by_job.get(job_id, [])]
        assert slots, f"job {job_id} has no run"
        assert len(slots) == len(set(slots)), f"job {job_id}: a slot ran twice"
        assert slots == [slots[0] + timedelta(seconds=i) for i in range(len(slots))], f"job {job_id}: a slot is missing"
        early = [r for r in by_job[job_id] if r["fired_at"] is not None and r["fired_at"] < r["scheduled_at"]]
        assert not early, f"job {job_id}: fired early: {early[:1]}"


class Writer:
    """Keeps the API busy while the move runs: creates jobs, pauses and resumes a job of the moving
    range and starts a run of it by hand, edits the tags of another and the start deadline (which the
    scheduler reads) of a third; every answer is recorded. Edits keep every slot: each job, edited or
    not, has one record per slot."""

    def __init__(self, client: httpx.AsyncClient, target: Target, paused: uuid.UUID,
                 edited: tuple[uuid.UUID, uuid.UUID]) -> None:
        self.client, self.target, self.paused, self.edited = client, target, paused, edited
        self.created: list[uuid.UUID] = []
        self.statuses: list[int] = []
        self._keys = iter(keys_in(*MOVED, 200, "during"))
        self._stop = asyncio.Event()

    async def run(self) -> None:
        while not self._stop.is_set():
            key = next(self._keys)
            self.created.append(await create(self.client, self.target, "during", key))
            for paused in (True, False):
                answer = await self.client.patch(f"/jobs/{self.paused}", json={"paused": paused})
                self.statuses.append(answer.status_code)
            manual = await self.client.post(f"/jobs/{self.paused}/runs")
            self.statuses.append(manual.status_code)
            tagged, replanned = self.edited
            edits = len(self.statuses)
            for job_id, change in ((tagged, {"tags": [f"during-{edits}"]}),
                                   (replanned, {"startDeadlineSec": 60 + edits % 7})):
                answer = await self.client.patch(f"/jobs/{job_id}", json=change)
                self.statuses.append(answer.status_code)
            await asyncio.sleep(0.3)

    def stop(self) -> None:
        self._stop.set()


async def move(processes: Processes, name: str, *args: str, env: dict[str, str] | None = None) -> ChimesProcess:
    return processes.start(name, "shards", "move", *args, env=env)


async def run_a_move(processes: Processes, client: httpx.AsyncClient, target: Target, database_url: str,
                     shard_url: str, stop_at: str | None = None) -> None:
    scheduler = processes.scheduler("node-1")
    worker = processes.worker("worker-1")
    kept, moving = await jobs_on_both_sides(client, target)
    await wait_for(lambda: all(len(target.calls_to(f"/moving-{i}")) >= 2 for i in range(6)), timeout=30,
                   what="every job to run before the move")
    writer = Writer(client, target, moving[0], (moving[3], moving[4]))
    writing = asyncio.create_task(writer.run())
    env = {"CHIMES_MOVE_STOP_AT": stop_at} if stop_at else None
    mover = await move(processes, "move", f"{MOVED[0]}-{MOVED[1]}", "--to", shard_url, env=env)
    if stop_at is not None:
        await wait_for(lambda: f"stopped at {stop_at}" in mover.output(), timeout=90, what=f"the mover at {stop_at}")
        for process in (mover, scheduler, worker):
            process.kill()
        scheduler = processes.scheduler("node-2")
        worker = processes.worker("worker-2")
        mover = await move(processes, "resume", "--resume")
    assert await mover.exited(timeout=120) == 0, mover.output()
    assert "done" in mover.output(), mover.output()
    writer.stop()
    await writing

    catalog_jobs, shard_jobs = await job_homes(database_url, shard_url)
    everything = {*kept, *moving, *writer.created}
    assert catalog_jobs | shard_jobs == everything  # nothing lost, nothing made twice
    assert shard_jobs == {j for j in everything if partition_of(j) >= MOVED[0]}
    assert catalog_jobs == {j for j in everything if partition_of(j) < MOVED[0]}
    assert set(writer.statuses) == {200, 202}, writer.statuses  # writes waited out the cut-over
    # Every job of the range goes on running from the target, and can be changed there.
    marks = {j: len(target.calls_to(f"/moving-{i}")) for i, j in enumerate(moving)}
    await wait_for(lambda: all(len(target.calls_to(f"/moving-{i}")) > marks[j] + 1 for i, j in enumerate(moving)),
                   timeout=30, what="the moved jobs to run from the target")
    patched = await client.patch(f"/jobs/{moving[1]}", json={"name": "renamed"})
    assert patched.status_code == 200, patched.text
    history = await client.get(f"/jobs/{moving[2]}/runs", params={"limit": 500})
    assert history.status_code == 200
    started_before = [r for r in history.json()["runs"] if r["status"] == "succeeded"]
    assert len(started_before) >= 3  # the runs from before the move came with it
    async def every_job_ran() -> bool:
        ran = {r["job_id"] for url in (database_url, shard_url) for r in await schedule_runs(url)}
        return everything <= ran

    await wait_for(every_job_ran, timeout=30, what="every job, the last ones created too, to have run")
    for process in (scheduler, worker):
        process.stop()
    check_slots(await schedule_runs(shard_url), shard_jobs)
    check_slots(await schedule_runs(database_url), catalog_jobs)
    moved_runs = {r["run_id"] for r in await schedule_runs(database_url) if partition_of(r["job_id"]) >= MOVED[0]}
    assert not moved_runs  # the source's copies are gone


async def test_a_range_moves_to_a_new_database_while_the_fleet_runs(
    processes: Processes, client: httpx.AsyncClient, target: Target, database_url: str, shard_url: str
) -> None:
    await run_a_move(processes, client, target, database_url, shard_url)


@pytest.mark.parametrize("phase", STOP_POINTS)
async def test_a_move_resumes_after_its_mover_scheduler_and_worker_are_killed(
    phase: str, processes: Processes, client: httpx.AsyncClient, target: Target, database_url: str, shard_url: str
) -> None:
    await run_a_move(processes, client, target, database_url, shard_url, stop_at=phase)


async def test_the_move_command_checks_first_and_cancels_a_stopped_move(
    processes: Processes, client: httpx.AsyncClient, target: Target, database_url: str, shard_url: str
) -> None:
    kept, moving = await jobs_on_both_sides(client, target)
    dry = await move(processes, "dry-run", f"{MOVED[0]}-{MOVED[1]}", "--to", shard_url, "--dry-run")
    assert await dry.exited(timeout=60) == 0, dry.output()
    assert f"partitions {MOVED[0]}-{MOVED[1]}: catalog -> " in dry.output()
    assert "6 jobs" in dry.output(), dry.output()  # the range's jobs (the deleted spares are gone)
    nowhere = await move(processes, "nowhere", f"{MOVED[0]}-{MOVED[1]}", "--to", "db2")
    assert await nowhere.exited(timeout=60) == 1
    assert "must be 'catalog', a shard's id, or a PostgreSQL URL" in nowhere.output(), nowhere.output()
    stopped = await move(processes, "stopped", f"{MOVED[0]}-{MOVED[1]}", "--to", shard_url,
                         env={"CHIMES_MOVE_STOP_AT": "fenced"})
    await wait_for(lambda: "stopped at fenced" in stopped.output(), timeout=60, what="the mover at the fence")
    listed = await shards_list(processes, "list-alive")
    assert "alive, heartbeat" in listed and "gone since" not in listed, listed
    stopped.kill()
    # Killed: within MOVER_GONE_AFTER_SEC of its last heartbeat the list says the mover is gone, since
    # when, and what to run; the target it registered shows, with no partitions yet.
    listed = await wait_for(lambda: _listed_gone(processes), timeout=MOVER_GONE_AFTER_SEC + 60, interval=1,
                            what="shards list to say the mover is gone")
    assert f"move 1: partitions {MOVED[0]}-{MOVED[1]} catalog -> shard 1, fenced for " in listed, listed
    assert "(when its mover stopped: waiting for the range's runs in flight)" in listed, listed
    assert "`chimes shards move --resume` takes it on, `--cancel` gives the range back" in listed, listed
    assert "\tshard 1\t" in listed and "(registered, no partitions yet" in listed, listed
    cancelled = await move(processes, "cancel", "--cancel")
    assert await cancelled.exited(timeout=60) == 0, cancelled.output()
    assert "cancelled" in cancelled.output()
    listed = await shards_list(processes, "list-cancelled")
    assert "shard map version 0" in listed and "shard 1\t" not in listed, listed  # the target went with the move
    catalog_jobs, shard_jobs = await job_homes(database_url, shard_url)
    assert (catalog_jobs, shard_jobs) == ({*kept, *moving}, set())
    # The range is the catalog's again: its jobs can be changed there.
    patched = await client.patch(f"/jobs/{moving[0]}", json={"name": "after the cancel"})
    assert patched.status_code == 200, patched.text


async def shards_list(processes: Processes, name: str) -> str:
    listed = processes.start(name, "shards", "list")
    assert await listed.exited(timeout=60) == 0, listed.output()
    return listed.output()


async def _listed_gone(processes: Processes) -> str | None:
    listed = await shards_list(processes, f"list-{uuid.uuid4().hex[:6]}")
    return listed if "gone since" in listed else None


async def test_a_mover_that_loses_its_source_says_so_and_resumes(
    processes: Processes, client: httpx.AsyncClient, target: Target, database_url: str, shard_url: str
) -> None:
    """The source's session of a mover waiting, fenced, for a run in flight is terminated (a restart, a
    failover): the command exits 1 with one line saying where the move stopped and how to go on, no
    traceback; once the run has ended, --resume finishes the move."""
    _, moving = await jobs_on_both_sides(client, target)
    assert (await client.post(f"/jobs/{moving[0]}/runs")).status_code == 202
    pool = await db.create_pool(database_url, max_size=2)
    try:
        worker = WorkerStore(pool, "slow-worker")
        [running] = await worker.claim(10, lease_sec=120, deadline_grace_sec=120)  # in flight: the drain waits
        mover = await move(processes, "move", f"{MOVED[0]}-{MOVED[1]}", "--to", shard_url)
        waiting = ("SELECT pid FROM pg_stat_activity "
                   "WHERE query LIKE '%What still runs, or waits to%' AND pid <> pg_backend_pid()")
        await wait_for(lambda: pool.fetchval(waiting), timeout=60, what="the mover waiting for the run in flight")
        await pool.execute(f"SELECT pg_terminate_backend(pid) FROM ({waiting}) AS mover")
        assert await mover.exited(timeout=60) == 1, mover.output()
        # Which database failed, and what it is to the move: the source (the catalog here).
        assert "move 1 stopped, fenced: a database it uses failed, the move's source, catalog (" in mover.output(), \
            mover.output()
        assert "chimes shards move --resume" in mover.output() and "Traceback" not in mover.output()
        done = Completion(running, Outcome.success(""), datetime.now(UTC), None)
        assert await worker.complete([done]) == {running.run_id}  # the source still takes its outcome
    finally:
        await pool.close()
    resumed = await move(processes, "resume", "--resume")
    assert await resumed.exited(timeout=120) == 0, resumed.output()
    assert "done" in resumed.output(), resumed.output()
    assert (await job_homes(database_url, shard_url))[1] == set(moving)
