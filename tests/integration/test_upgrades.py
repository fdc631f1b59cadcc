"""Expand and contract migrations, the releases processes record, and the upgrade plan, on a real
database (chimes.store.migrate, chimes.store.upgrades; docs/operations.md, "Upgrades")."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import asyncpg
import pydantic
import pytest

from chimes import __version__
from chimes.cli.upgrades import contract_homes, read_plan
from chimes.jobs import JobPatch, JobSpec
from chimes.services.jobs import JobService
from chimes.store import db
from chimes.store.migrate import (
    Migration,
    ReleaseTooOld,
    applied_steps,
    migrate,
    migrations,
    parse_migration,
    release_key,
)
from chimes.store.scheduling import SchedulerStore
from chimes.store.shards import add_shard
from chimes.store.upgrades import read_home_plan, upgrade_plan
from chimes.store.working import WorkerStore
from tests.conftest import TEMPLATE, scratch_database

pytestmark = pytest.mark.single_database("about one database's migrations")

CONTRACT = Migration(9001, "drop_old_column", "-- contract: requires every process at release >= 0.2.0\n"
                     "ALTER TABLE jobs DROP COLUMN IF EXISTS only_0_1_0_reads;", contract_release="0.2.0")
EXPAND = Migration(9002, "add_column", "ALTER TABLE jobs ADD COLUMN later_expand text;")


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(database_url)
    yield connection
    await connection.close()


def test_a_contract_step_is_marked_on_its_first_line() -> None:
    step = parse_migration("0021_drop_x.sql", "-- contract: requires every process at release >= 0.2.0\nDROP x;")
    assert (step.version, step.name, step.contract_release) == (21, "drop_x", "0.2.0")
    plain = parse_migration("0022_add_y.sql", "-- Adds y.\nALTER TABLE t ADD COLUMN y int;")
    assert plain.contract_release is None
    with pytest.raises(ValueError, match=re.escape("a contract step opens with '-- contract: requires every "
                                                   "process at release >= X.Y.Z', not '-- contract: needs 0.2'")):
        parse_migration("0023_z.sql", "-- contract: needs 0.2\nDROP z;")


def test_the_shipped_migrations_parse_and_releases_compare_by_number() -> None:
    assert [m.version for m in migrations()] == sorted({m.version for m in migrations()})
    assert release_key("0.10.0") > release_key("0.9.0") > release_key("0.2.0")


async def test_start_up_applies_expand_steps_and_holds_contract_steps(conn: asyncpg.Connection) -> None:
    await conn.execute("ALTER TABLE jobs ADD COLUMN only_0_1_0_reads text")
    steps = [*migrations(), CONTRACT, EXPAND]
    assert await migrate(conn, steps=steps) == [9002]  # the later expand step does not wait for the contract
    assert await conn.fetchval("SELECT count(*) FROM schema_migrations WHERE version = 9001") == 0
    plan = upgrade_plan([await read_home_plan(conn, "catalog", steps)])
    assert [m.label for m in plan.homes[0].contract] == ["9001_drop_old_column"]
    assert plan.can_contract and "contract: ready (`chimes migrate --contract`)" in plan.describe()

    assert await migrate(conn, contract=True, steps=steps) == [9001]
    assert await conn.fetchval("SELECT count(*) FROM information_schema.columns "
                               "WHERE table_name = 'jobs' AND column_name = 'only_0_1_0_reads'") == 0
    applied = {s.version: s.contract_release for s in await applied_steps(conn)}
    assert applied[9001] == "0.2.0" and applied[9002] is None and len(applied) == len(steps)
    # What release 0.1.0 reads at start-up now raises, naming the release to run.
    with pytest.raises(asyncpg.RaiseError, match=r"needs chimes 0\.2\.0 or later .* run chimes 0\.2\.0 or later"):
        await conn.fetch("SELECT version FROM schema_migrations")
    assert await migrate(conn, contract=True, steps=steps) == []  # and this release runs on


async def test_a_live_process_of_an_older_release_holds_a_contract_step(conn: asyncpg.Connection) -> None:
    await conn.execute("INSERT INTO workers (worker_id, hostname, pid, concurrency) VALUES ('w-old', 'h', 1, 4)")
    await conn.execute("INSERT INTO scheduler_nodes (node_id, hostname, pid, release) VALUES ('n-new', 'h', 2, $1)",
                       __version__)
    await conn.execute("INSERT INTO api_servers (server_id, hostname, pid, release) VALUES ('a-old', 'h', 3, '0.1.5')")
    steps = [*migrations(), CONTRACT]
    plan = upgrade_plan([await read_home_plan(conn, "catalog", steps)])
    assert not plan.can_contract
    assert [(step.version, [str(p) for p in older]) for step, older in plan.blockers()] == [
        (9001, ["api a-old (0.1.5)", "worker w-old (0.1.0 or earlier)"])]
    assert ("contract: 9001_drop_old_column needs every process at 0.2.0 or later; waiting for: "
            "api a-old (0.1.5), worker w-old (0.1.0 or earlier)") in plan.describe()
    # Processes whose heartbeats stopped are not live: nothing holds the step any more.
    await conn.execute("UPDATE workers SET heartbeat_at = now() - interval '61 seconds'")
    await conn.execute("UPDATE api_servers SET heartbeat_at = now() - interval '31 seconds'")
    assert upgrade_plan([await read_home_plan(conn, "catalog", steps)]).can_contract


async def test_a_release_older_than_the_schema_refuses_and_changes_nothing(conn: asyncpg.Connection) -> None:
    later = Migration(9003, "for_0_3_0", "SELECT 1", contract_release="0.3.0")
    await migrate(conn, contract=True, steps=[*migrations(), later], release="0.3.0")
    before = [(s.version, s.contract_release) for s in await applied_steps(conn)]
    with pytest.raises(ReleaseTooOld, match=r"this database's schema needs chimes 0\.3\.0 or later \(contract "
                                            r"migration 9003_for_0_3_0 was applied\); this is chimes 0\.2\.9: "
                                            r"run chimes 0\.3\.0 or later"):
        await migrate(conn, steps=[*migrations(), EXPAND], release="0.2.9")
    assert [(s.version, s.contract_release) for s in await applied_steps(conn)] == before
    plan = upgrade_plan([await read_home_plan(conn, "catalog")], release="0.2.9")
    assert plan.too_old_for == "0.3.0" and not plan.can_contract
    assert "cannot roll: the schema needs chimes 0.3.0 or later; this is chimes 0.2.9" in plan.describe()


async def test_a_database_no_process_has_used_gets_every_step_at_once(server_dsn: str) -> None:
    async with scratch_database(server_dsn, "chimes_fresh") as dsn:
        conn = await asyncpg.connect(dsn)
        try:
            steps = [*migrations(), CONTRACT]
            assert (await read_home_plan(conn, "catalog", steps)).contract == ()  # nothing older can be live
            assert await migrate(conn, steps=steps) == [m.version for m in steps]
            assert {s.version: s.contract_release for s in await applied_steps(conn)}[9001] == "0.2.0"
        finally:
            await conn.close()


async def test_scheduler_nodes_and_workers_record_their_release(database_url: str) -> None:
    pool = await db.create_pool(database_url, max_size=2)
    try:
        await WorkerStore(pool, "w-1").register("host", 10, 4, 0)
        await SchedulerStore(pool, "n-1").sync_leases("host", 11, {}, 5.0)
        nodes = await pool.fetch("SELECT node_id, release FROM scheduler_nodes")
        workers = await pool.fetch("SELECT worker_id, release FROM workers")
    finally:
        await pool.close()
    assert [tuple(r) for r in nodes] == [("n-1", __version__)]
    assert [tuple(r) for r in workers] == [("w-1", __version__)]


async def test_the_plan_and_the_contract_cover_every_shard(single_database_url: str, server_dsn: str) -> None:
    """With shards, `chimes migrate --plan` reads each home (a worker heartbeats on every home it serves) and
    `--contract` migrates each one."""
    async with scratch_database(server_dsn, "chimes_upgrade_shard", TEMPLATE) as shard_url:
        catalog = await asyncpg.connect(single_database_url)
        shard = await asyncpg.connect(shard_url)
        try:
            shard_map = await add_shard(catalog, shard_url, 512, 1023)
            await shard.execute("INSERT INTO workers (worker_id, hostname, pid, concurrency) "
                                "VALUES ('old-worker', 'h', 1, 4)")
            plan = await read_plan(single_database_url)
            assert [home.home for home in plan.homes] == ["catalog", f"shard {shard_map.ranges[-1].shard_id}"]
            assert [str(p) for p in plan.live] == ["worker old-worker (0.1.0 or earlier)"]
            assert plan.can_contract  # no contract step is pending: nothing waits for the old worker
            assert [applied for _, applied in await contract_homes(single_database_url)] == [[], []]
        finally:
            await catalog.close()
            await shard.close()


async def test_a_job_stored_with_headers_of_chimes_own_loses_them_and_can_be_changed_again(
    database_url: str, conn: asyncpg.Connection
) -> None:
    """Migration 0024: such headers were never sent, and the API now refuses them; a job stored with
    one (by an older release) could not be changed at all, since a change validates the whole job."""
    pool = await db.create_pool(database_url, max_size=2)
    try:
        service = JobService(pool)
        job = (await service.create("team-a", JobSpec.model_validate(
            {"name": "old", "schedule": {"cron": "0 2 * * *"}, "task": {"type": "http", "url": "http://127.0.0.1:9/"}}),
            datetime.now(UTC))).job_id
        await conn.execute("""UPDATE jobs SET task = task || '{"headers": {"X-Chimes-Run-Id": "forged", "X-Team": "a"},
                              "secretHeaders": {"x-chimes-signature": "gAAAA-sealed", "Authorization": "gAAAA-sealed"}}'
                              WHERE job_id = $1""", job)
        version = await conn.fetchval("SELECT version FROM jobs WHERE job_id = $1", job)
        with pytest.raises(pydantic.ValidationError, match="X-Chimes-"):
            await service.update(job, "team-a", JobPatch(paused=True), datetime.now(UTC))
        [step] = [m for m in migrations() if m.name == "reserved_task_headers"]
        await conn.execute(step.sql)
        headers = await conn.fetchrow("SELECT task -> 'headers' AS plain, task -> 'secretHeaders' AS secret "
                                      "FROM jobs WHERE job_id = $1", job)
        assert (json.loads(headers["plain"]), json.loads(headers["secret"])) == ({"X-Team": "a"},
                                                                                 {"Authorization": "gAAAA-sealed"})
        assert await conn.fetchval("SELECT version FROM jobs WHERE job_id = $1", job) == version
        assert (await service.update(job, "team-a", JobPatch(paused=True), datetime.now(UTC))) is not None
    finally:
        await pool.close()
