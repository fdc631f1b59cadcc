"""A move's fences and refusals, against real databases: a router still on the old map is refused by
the source and retries on the target; the source refuses job writes once fenced; a run whose worker
froze past its lease is handed over and the worker's late outcome refused; a cancelled move gives the
range back; a move that cannot be made changes nothing (docs/scaling.md, "Moving partitions").
tests/e2e/test_shard_moves.py moves a range under a running fleet."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx
import pytest

from chimes import moves
from chimes.ids import partition_of
from chimes.store import db
from chimes.store import moves as move_store
from chimes.store.queries import sql
from chimes.store.shards import load_map, shards_without_ranges
from chimes.store.working import Completion, WorkerStore
from chimes.worker.tasks.common import Outcome
from tests.conftest import scratch_database
from tests.helpers import wait_for
from tests.integration.test_shard_added_while_running import create, job_ids
from tests.integration.test_shard_added_while_running import stale_api as stale_api  # the fixture, shared

pytestmark = pytest.mark.own_shard_map  # databases and a shard map of their own, whatever --shards says

MOVED = (512, 1023)


@pytest.fixture
async def shard_url(server_dsn: str) -> AsyncIterator[str]:
    async with scratch_database(server_dsn, "chimes_move_target") as dsn:
        yield dsn


async def jobs_in_range(client: httpx.AsyncClient, count: int) -> list[uuid.UUID]:
    """``count`` jobs in MOVED (with one database the API makes random ids: the others are deleted)."""
    found: list[uuid.UUID] = []
    for attempt in range(20 * count):
        job_id = await create(client, f"job-{attempt}")
        if partition_of(job_id) >= MOVED[0]:
            found.append(job_id)
            if len(found) == count:
                return found
        else:
            assert (await client.delete(f"/jobs/{job_id}")).status_code == 204
    raise AssertionError(f"not {count} random job ids in {MOVED}")


@contextlib.asynccontextmanager
async def mover_at(catalog_url: str, target: str, stop_at: str | None = None) -> AsyncIterator[asyncio.Task[None]]:
    """A move of MOVED to ``target`` run in this loop, stopped at ``stop_at`` (None: to the end)."""
    catalog = await db.connect(catalog_url)
    move, _ = await moves.begin_move(catalog, catalog_url, *MOVED, target)
    assert move is not None
    await moves.lock_mover(catalog)
    homes = await moves.homes_of(catalog, catalog_url, move)
    mover = moves.Mover(catalog, homes, move, report=lambda _: None,
                        stop_at=moves.hold_at(stop_at) if stop_at else None)

    async def run() -> None:
        await mover.run()

    task = asyncio.create_task(run())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await catalog.close()


async def mover_of(catalog: db.Connection, catalog_url: str, move: move_store.Move) -> moves.Mover:
    """The mover of ``move``, holding the mover's lock on ``catalog``."""
    await moves.lock_mover(catalog)
    return moves.Mover(catalog, await moves.homes_of(catalog, catalog_url, move), move,
                       report=lambda _: None)


async def resume(catalog_url: str) -> move_store.Move:
    catalog = await db.connect(catalog_url)
    try:
        move = await move_store.move_under_way(catalog)
        assert move is not None
        await moves.lock_mover(catalog)
        homes = await moves.homes_of(catalog, catalog_url, move)
        return await moves.Mover(catalog, homes, move, report=lambda _: None).run()
    finally:
        await catalog.close()


async def phase(catalog_url: str) -> str | None:
    conn = await asyncpg.connect(catalog_url)
    try:
        return await conn.fetchval("SELECT phase FROM shard_moves ORDER BY move_id DESC LIMIT 1")  # type: ignore[no-any-return]
    finally:
        await conn.close()


async def test_a_router_on_the_old_map_is_refused_by_the_source_and_writes_on_the_target(
    stale_api: httpx.AsyncClient, database_url: str, shard_url: str
) -> None:
    renamed, started, deleted = await jobs_in_range(stale_api, 3)
    async with mover_at(database_url, shard_url) as moving:
        await moving
    assert await job_ids(shard_url) == {renamed, started, deleted}
    assert await job_ids(database_url) == set()
    # This API read the map at start (no shards) and does not follow it: each write goes to the catalog
    # first, is refused there (the range's lease rows are closed), and is made again on the shard.
    patched = await stale_api.patch(f"/jobs/{renamed}", json={"name": "renamed"})
    assert patched.status_code == 200, patched.text
    manual = await stale_api.post(f"/jobs/{started}/runs")
    assert manual.status_code == 202, manual.text
    assert (await stale_api.delete(f"/jobs/{deleted}")).status_code == 204
    shard = await asyncpg.connect(shard_url)
    try:
        assert await shard.fetchval("SELECT name FROM jobs WHERE job_id = $1", renamed) == "renamed"
        assert await shard.fetchval("SELECT count(*) FROM runs WHERE job_id = $1 AND trigger = 'manual'", started) == 1
        assert await shard.fetchval("SELECT count(*) FROM jobs WHERE job_id = $1", deleted) == 0
    finally:
        await shard.close()
    assert (await stale_api.get(f"/jobs/{renamed}")).json()["name"] == "renamed"


async def test_a_router_on_the_old_map_reads_a_moved_job_from_the_target(
    stale_api: httpx.AsyncClient, database_url: str, shard_url: str
) -> None:
    (job_id,) = await jobs_in_range(stale_api, 1)
    async with mover_at(database_url, shard_url) as moving:
        await moving
    assert await job_ids(database_url) == set()  # the source's copy is gone: only the target has the job
    # This API still has the map it read at start; its first request after the move is a read, which
    # the source answers "not found": the API reads the map again and asks the target.
    found = await stale_api.get(f"/jobs/{job_id}")
    assert found.status_code == 200, found.text
    assert found.json()["jobId"] == str(job_id)
    runs = await stale_api.get(f"/jobs/{job_id}/runs")
    assert runs.status_code == 200, runs.text
    # A job that is nowhere is still not found, with the map unchanged.
    missing = await stale_api.get(f"/jobs/{uuid.uuid4()}")
    assert missing.status_code == 404 and missing.json()["error"] == "not_found", missing.text


async def test_a_fenced_source_refuses_job_writes_and_the_api_waits_for_the_cut_over(
    stale_api: httpx.AsyncClient, database_url: str, shard_url: str
) -> None:
    (job_id,) = await jobs_in_range(stale_api, 1)
    async with mover_at(database_url, shard_url, stop_at="fenced"):
        await wait_for(lambda: phase(database_url), timeout=20, what="the move to start")
        await wait_for(_is(database_url, "fenced"), timeout=20, what="the fence")
        catalog = await asyncpg.connect(database_url)
        try:
            with pytest.raises(asyncpg.PostgresError) as refused:
                await catalog.fetchrow(sql("lock_job"), job_id, None)
            assert refused.value.sqlstate == "CH001"
            closed = await catalog.fetchval(
                "SELECT count(*) FROM partition_leases WHERE partition_id BETWEEN $1 AND $2 "
                "AND closed_by_move IS NOT NULL AND expires_at = 'infinity'", *MOVED)
            assert closed == MOVED[1] - MOVED[0] + 1
        finally:
            await catalog.close()
        # A write now waits (the API replays it) until the move cuts over, then lands on the target.
        patching = asyncio.create_task(stale_api.patch(f"/jobs/{job_id}", json={"name": "after the fence"}))
        await asyncio.sleep(0.5)
        assert not patching.done()
    await resume(database_url)
    patched = await patching
    assert patched.status_code == 200, patched.text
    assert await job_ids(shard_url) == {job_id}


async def lease_of(url: str, run_id: uuid.UUID) -> asyncpg.Record | None:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetchrow(  # type: ignore[no-any-return]
            "SELECT r.status, r.lease_token, l.token, l.expires_at < now() AS expired FROM runs r "
            "LEFT JOIN run_leases l ON l.run_id = r.run_id WHERE r.run_id = $1", run_id)
    finally:
        await conn.close()


async def test_a_run_whose_worker_froze_is_handed_over_and_its_late_outcome_refused(
    stale_api: httpx.AsyncClient, database_url: str, shard_url: str
) -> None:
    """A worker frozen past its lease (its claim's lease row expired, no heartbeat) while the range
    moves: the source hands the run over under a new token once the range is at rest, so the
    worker's outcome, should it wake before the clean-up, is refused instead of accepted and then
    deleted with the source's copies; the target gets the run with an expired lease for its reaper."""
    [job_id] = await jobs_in_range(stale_api, 1)
    assert (await stale_api.post(f"/jobs/{job_id}/runs")).status_code == 202
    pool = await db.create_pool(database_url, max_size=2)
    try:
        worker = WorkerStore(pool, "frozen-worker")
        [claimed] = await worker.claim(10, lease_sec=30, deadline_grace_sec=30)
        await pool.execute("UPDATE claim_leases SET expires_at = now() - interval '1 second'")  # frozen past it
        async with mover_at(database_url, shard_url, stop_at="drained"):
            async def handed_over() -> bool:
                lease = await lease_of(database_url, claimed.run_id)
                return lease is not None and lease["token"] is not None
            await wait_for(handed_over, timeout=20, what="the run handed over on the source")
            source = await lease_of(database_url, claimed.run_id)
            assert source is not None and source["status"] == "running" and source["expired"]
            assert source["lease_token"] == source["token"] != claimed.lease_token
            # The worker wakes: its outcome and its renewal change nothing on the source any more.
            late = Completion(claimed, Outcome.failure("HTTP 500"), datetime.now(UTC),
                              datetime.now(UTC) + timedelta(seconds=1))
            assert await worker.complete([late]) == set()
            assert await worker.extend_leases([claimed], 30) == set()
        moved = await resume(database_url)
        assert moved.phase == "done"
    finally:
        await pool.close()
    target = await lease_of(shard_url, claimed.run_id)
    assert target is not None and target["status"] == "running"
    # (the resumed mover handed it over once more: another new token, never the worker's)
    assert target["token"] == target["lease_token"] != claimed.lease_token and target["expired"]  # the reaper's now
    assert await lease_of(database_url, claimed.run_id) is None


async def test_runs_that_arrive_with_nothing_to_end_or_start_them_are_leased_or_queued_by_the_target(
    stale_api: httpx.AsyncClient, database_url: str, shard_url: str
) -> None:
    """The target's own check once it has opened the range: a running run it holds with no lease in
    force under its token gets one, expired, so that its reaper ends the attempt; a scheduled run with
    no queue entry, retry trigger or active run to wait for is queued. Neither should happen (the
    source hands every run over, and its queue of the range is empty at the drain): here the target's
    copies are altered by hand at the stop after the cut-over, before the target opens the range."""
    for job_id in await jobs_in_range(stale_api, 2):
        assert (await stale_api.post(f"/jobs/{job_id}/runs")).status_code == 202
    pool = await db.create_pool(database_url, max_size=2)
    try:
        unleased, unqueued = await WorkerStore(pool, "frozen-worker").claim(10, lease_sec=30, deadline_grace_sec=30)
        await pool.execute("UPDATE claim_leases SET expires_at = now() - interval '1 second'")
    finally:
        await pool.close()
    async with mover_at(database_url, shard_url, stop_at="cut_over"):
        await wait_for(_is(database_url, "cut_over"), timeout=20, what="the cut-over")
        target = await asyncpg.connect(shard_url)
        try:
            await target.execute("DELETE FROM run_leases")
            await target.execute("UPDATE runs SET status = 'scheduled', lease_token = NULL, worker_id = NULL "
                                 "WHERE run_id = $1", unqueued.run_id)
        finally:
            await target.close()
    assert (await resume(database_url)).phase == "done"
    leased = await lease_of(shard_url, unleased.run_id)
    assert leased is not None and leased["status"] == "running"
    assert leased["token"] == leased["lease_token"] and leased["expired"]
    target = await asyncpg.connect(shard_url)
    try:
        assert await target.fetchval("SELECT count(*) FROM run_queue WHERE run_id = $1", unqueued.run_id) == 1
    finally:
        await target.close()


async def test_a_partition_found_empty_but_copied_with_a_row_is_copied_again(
    stale_api: httpx.AsyncClient, database_url: str, shard_url: str
) -> None:
    """A row written on the source between a pass's fingerprint of its partition (empty) and the copy
    is copied, and the partition recorded as unknown: deleted on the source before the next pass, it
    is deleted on the target by that pass, not kept because both sides' fingerprints say empty."""
    [job_id] = await jobs_in_range(stale_api, 1)
    jobs = next(table for table in move_store.MOVED_TABLES if table.name == "jobs")
    catalog = await db.connect(database_url)
    try:
        move, _ = await moves.begin_move(catalog, database_url, *MOVED, shard_url)
        assert move is not None
        mover = await mover_of(catalog, database_url, move)
        await mover.connect()
        try:
            # The fingerprints were read before the job was written: its partition looked empty.
            copied = await move_store.copy_partitions(mover._src, mover._dst, move.move_id, jobs,
                                                      [partition_of(job_id)], {})
            assert copied == 1
            assert await job_ids(shard_url) == {job_id}
            assert (await stale_api.delete(f"/jobs/{job_id}")).status_code == 204
            _, differed = await mover._pass()
            assert differed >= 1
            assert await job_ids(shard_url) == set()  # gone from the source, gone from the copy
            _, differed = await mover._pass()
            assert differed == 0
        finally:
            await mover.close()
    finally:
        await catalog.close()


def _is(url: str, wanted: str):  # type: ignore[no-untyped-def]
    async def check() -> bool:
        return await phase(url) == wanted
    return check


async def test_a_mover_beats_while_it_waits_and_a_stopped_one_is_told_gone(
    stale_api: httpx.AsyncClient, database_url: str, shard_url: str
) -> None:
    """The mover's heartbeat goes on while its work waits (here, held at the fence as a drain would
    hold it); once the mover is stopped it ages, and the move read says who is gone and what to run."""
    await jobs_in_range(stale_api, 1)
    async with mover_at(database_url, shard_url, stop_at="fenced"):
        await wait_for(_is(database_url, "fenced"), timeout=20, what="the fence")
        beat = (await _under_way(database_url)).heartbeat_at
        assert beat is not None
        await wait_for(lambda: _beat_after(database_url, beat), timeout=10, what="a heartbeat while the mover waits")
        alive = await _under_way(database_url)
        assert not alive.mover_gone
        assert (alive.liveness() or "").startswith(f"mover {alive.mover} alive, heartbeat "), alive.liveness()
        assert alive.fenced_sec is not None and ", fenced for " in alive.describe()
    # Stopped (its task cancelled, its connections closed): the heartbeat ages, read on the catalog's clock.
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("UPDATE shard_moves SET heartbeat_at = heartbeat_at - make_interval(secs => $1)",
                           move_store.MOVER_GONE_AFTER_SEC)
    finally:
        await conn.close()
    gone = await _under_way(database_url)
    assert gone.mover_gone
    line = gone.describe()
    assert ", fenced for " in line and f"; mover {gone.mover} gone since " in line, line
    assert "`chimes shards move --resume` takes it on, `--cancel` gives the range back" in line, line


async def _under_way(url: str) -> move_store.Move:
    conn = await db.connect(url)
    try:
        move = await move_store.move_under_way(conn)
    finally:
        await conn.close()
    assert move is not None
    return move


async def _beat_after(url: str, then: datetime) -> bool:
    move = await _under_way(url)
    return move.heartbeat_at is not None and move.heartbeat_at > then


async def test_a_cancelled_move_gives_the_range_back_to_its_source(
    stale_api: httpx.AsyncClient, database_url: str, shard_url: str
) -> None:
    jobs = set(await jobs_in_range(stale_api, 2))
    catalog = await db.connect(database_url)
    version_before = (await load_map(catalog)).version
    await catalog.close()
    async with mover_at(database_url, shard_url, stop_at="drained"):
        await wait_for(_is(database_url, "fenced"), timeout=20, what="the fence")
    catalog = await db.connect(database_url)
    try:
        # Before the cut-over the target is registered, with no range: listed as such.
        [(registered, url)] = await shards_without_ranges(catalog)
        move = await move_store.move_under_way(catalog)
        assert move is not None
        assert (registered, url) == (move.target_shard, shard_url)
        mover = await mover_of(catalog, database_url, move)
        await mover.connect()
        try:
            cancelled = await mover.cancel("a test cancels it")
        finally:
            await mover.close()
        assert cancelled.phase == "cancelled" and cancelled.note == "a test cancels it"
        assert (await load_map(catalog)).ranges == ()  # the catalog holds the range, as before
        # The target the move registered (--to URL) goes with it: no shard of the map, none registered.
        assert await catalog.fetchval("SELECT count(*) FROM shards") == 0
        assert await shards_without_ranges(catalog) == []
        assert (await load_map(catalog)).version == version_before
        assert await catalog.fetchval("SELECT count(*) FROM partition_leases WHERE closed_by_move IS NOT NULL") == 0
    finally:
        await catalog.close()
    assert await job_ids(database_url) == jobs
    assert await job_ids(shard_url) == set()  # the copies are gone
    patched = await stale_api.patch(f"/jobs/{next(iter(jobs))}", json={"name": "still here"})
    assert patched.status_code == 200, patched.text


async def test_a_move_that_cannot_be_made_changes_nothing(
    stale_api: httpx.AsyncClient, database_url: str, shard_url: str
) -> None:
    catalog = await db.connect(database_url)
    try:
        with pytest.raises(moves.MoveError, match="live in catalog already"):
            await moves.begin_move(catalog, database_url, *MOVED, "catalog")
        with pytest.raises(moves.MoveError, match="there is no shard 7"):
            await moves.begin_move(catalog, database_url, *MOVED, "7")
        with pytest.raises(moves.MoveError, match="must be 'catalog'"):
            await moves.begin_move(catalog, database_url, *MOVED, "somewhere")
        await catalog.execute("INSERT INTO scheduler_nodes (node_id, hostname, pid, release) "
                              "VALUES ('old-node', 'old-host', 1, '0.2.0')")
        with pytest.raises(moves.MoveError, match=r"release 0\.3\.0 or later; still live: scheduler old-node"):
            await moves.begin_move(catalog, database_url, *MOVED, shard_url)
        await catalog.execute("DELETE FROM scheduler_nodes")
        assert await catalog.fetchval("SELECT count(*) FROM shard_moves") == 0
        assert await catalog.fetchval("SELECT count(*) FROM shards") == 0
        move, _ = await moves.begin_move(catalog, database_url, 0, 9, shard_url)
        assert move is not None
        with pytest.raises(moves.MoveError, match="another move is under way"):
            await moves.begin_move(catalog, database_url, 10, 19, shard_url)
        with pytest.raises(moves.MoveError, match="another `chimes shards move` is running"):
            other = await db.connect(database_url)
            try:
                await moves.lock_mover(other)
                await moves.lock_mover(catalog)
            finally:
                await other.close()
    finally:
        await catalog.close()
