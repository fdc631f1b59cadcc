"""The shard map in the catalog, its pools, and ``chimes shards list|add`` on real databases.

The shards here are other databases of the test server, and one on a server of its own."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import asyncpg
import httpx
import pytest
from click.testing import CliRunner, Result

from chimes.cli.main import cli
from chimes.cli.runtime import migrate_shards, prepare_role_database
from chimes.ids import partition_of
from chimes.store import db
from chimes.store.caps import Cap, list_caps, remove_cap, set_cap
from chimes.store.migrate import migrations
from chimes.store.shards import ShardMapError, ShardPools, add_shard, load_map, without_password
from tests.conftest import scratch_database, with_database

_numbers = iter(range(1_000_000))
pytestmark = pytest.mark.own_shard_map  # each test builds its map from an empty one


@pytest.fixture
def database_url(single_database_url: str) -> str:
    """The catalog, its map empty whatever --shards says."""
    return single_database_url


@pytest.fixture
async def new_database(server_dsn: str) -> AsyncIterator[str]:
    """An empty database (no Chimes tables) on the test server."""
    async with scratch_database(server_dsn, "chimes_shard") as dsn:
        yield dsn


@pytest.fixture
async def catalog(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await db.connect(database_url)
    yield conn
    await conn.close()


def job_in(first: int, last: int) -> uuid.UUID:
    """A job id whose partition lies in first-last."""
    while True:
        job_id = uuid.uuid4()
        if first <= partition_of(job_id) <= last:
            return job_id


async def tables_of(url: str) -> set[str]:
    conn = await asyncpg.connect(url)
    try:
        return {r["tablename"] for r in await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    finally:
        await conn.close()


async def test_the_empty_map_is_the_catalog(catalog: asyncpg.Connection, pool: asyncpg.Pool) -> None:
    shard_map = await load_map(catalog)
    assert (shard_map.version, shard_map.ranges) == (0, ())
    pools = ShardPools(pool, shard_map)
    assert {await pools.for_partition(p) for p in range(1024)} == {pool}
    assert await pools.for_job(uuid.uuid4()) is pool
    assert pools.opened() == 0


async def test_a_shard_is_migrated_and_takes_its_partitions(catalog: asyncpg.Connection, pool: asyncpg.Pool,
                                                            new_database: str) -> None:
    shard_map = await add_shard(catalog, new_database, 512, 1023)
    assert shard_map.version == 1
    [added] = shard_map.ranges
    assert (added.first, added.last, added.url, added.since_version) == (512, 1023, new_database, 1)
    shard = await asyncpg.connect(new_database)
    try:
        applied = [r["version"] for r in await shard.fetch("SELECT version FROM schema_migrations ORDER BY 1")]
        assert applied == [m.version for m in migrations()]
    finally:
        await shard.close()

    pools = ShardPools(pool, await load_map(catalog), max_size=3)
    try:
        # Many first requests at once open one pool, bounded.
        opened = await asyncio.gather(*(pools.for_job(job_in(512, 1023)) for _ in range(20)))
        assert len(set(opened)) == 1 and pools.opened() == 1
        shard_pool = opened[0]
        assert shard_pool is not pool and shard_pool.get_max_size() == 3
        shard_name = urlsplit(new_database).path.lstrip("/")
        assert await shard_pool.fetchval("SELECT current_database()") == shard_name
        in_catalog = await pools.for_job(job_in(0, 511))
        assert await in_catalog.fetchval("SELECT current_database()") == \
            await catalog.fetchval("SELECT current_database()")
    finally:
        await pools.close()


async def assert_unchanged(catalog: asyncpg.Connection, version: int, shard_url: str, shard_tables: set[str]) -> None:
    assert (await load_map(catalog)).version == version
    assert await tables_of(shard_url) == shard_tables


async def test_refused_changes_change_nothing(catalog: asyncpg.Connection, database_url: str, new_database: str,
                                              server_dsn: str) -> None:
    await add_shard(catalog, new_database, 512, 1023)
    shard_tables = await tables_of(new_database)
    for first, last, overlapped in [(512, 600, "512-1023"), (0, 512, "512-1023"), (1000, 1023, "512-1023")]:
        with pytest.raises(ShardMapError, match=f"partitions {first}-{last} overlap {overlapped} \\(shard 1\\)"):
            await add_shard(catalog, new_database, first, last)
        await assert_unchanged(catalog, 1, new_database, shard_tables)
    for first, last in [(5, 3), (-1, 3), (0, 1024)]:
        with pytest.raises(ShardMapError, match="must lie within 0-1023"):
            await add_shard(catalog, new_database, first, last)
    with pytest.raises(ShardMapError, match="is the catalog database itself"):
        await add_shard(catalog, database_url, 0, 10)
    await assert_unchanged(catalog, 1, new_database, shard_tables)
    with pytest.raises(ShardMapError, match="URL is empty"):
        await add_shard(catalog, " ", 0, 10)
    await assert_unchanged(catalog, 1, new_database, shard_tables)


async def test_a_database_that_holds_jobs_is_refused_untouched(catalog: asyncpg.Connection, database_url: str,
                                                               template_dsn: str, server_dsn: str) -> None:
    # Another Chimes database with a job: it is neither migrated nor mapped.
    name = f"chimes_other_{os.getpid()}_{next(_numbers)}"
    admin = await asyncpg.connect(server_dsn)
    await admin.execute(f"CREATE DATABASE {name} TEMPLATE {urlsplit(template_dsn).path.lstrip('/')}")
    other = with_database(server_dsn, name)
    try:
        conn = await asyncpg.connect(other)
        await conn.execute("DELETE FROM schema_migrations WHERE version = (SELECT max(version) FROM schema_migrations)")
        await conn.execute("INSERT INTO jobs (job_id, owner, name, task, retry_policy, timeout_sec, concurrency, "
                           "priority, cron) VALUES ($1, 'team-a', 'x', '{}', '{}', 60, 'allow', 0, '@hourly')",
                           uuid.uuid4())
        await conn.close()
        before = await tables_of(other)
        with pytest.raises(ShardMapError, match="holds jobs already: a new shard must start empty"):
            await add_shard(catalog, other, 0, 10)
        conn = await asyncpg.connect(other)
        assert await conn.fetchval("SELECT count(*) FROM schema_migrations") == len(migrations()) - 1
        await conn.close()
        await assert_unchanged(catalog, 0, other, before)
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()


async def test_partitions_holding_jobs_are_not_moved(client: httpx.AsyncClient, catalog: asyncpg.Connection,
                                                     pool: asyncpg.Pool, new_database: str) -> None:
    created = await client.post("/jobs", json={"name": "paused", "schedule": {"cron": "@hourly"},
                                               "task": {"type": "http", "url": "http://127.0.0.1:9/x"}})
    assert created.status_code == 201, created.text
    job_id = uuid.UUID(created.json()["jobId"])
    paused = await client.patch(f"/jobs/{job_id}", json={"paused": True})
    assert paused.status_code == 200, paused.text
    # A paused job has no trigger: only its row says that its partition is in use.
    assert await pool.fetchval("SELECT count(*) FROM triggers WHERE job_id = $1", job_id) == 0
    held = partition_of(job_id)
    with pytest.raises(ShardMapError, match=f"partitions {held} hold jobs in the catalog database"):
        await add_shard(catalog, new_database, held, held)
    await assert_unchanged(catalog, 0, new_database, set())  # the new database was not even migrated
    around = [(0, held - 1)] if held > 0 else []
    around += [(held + 1, 1023)] if held < 1023 else []
    for first, last in around:
        await add_shard(catalog, new_database, first, last)
    assert (await load_map(catalog)).in_catalog() == [(held, held)]


async def test_the_api_migrates_every_shard_at_start(catalog: asyncpg.Connection, database_url: str,
                                                      new_database: str) -> None:
    assert (await prepare_role_database(database_url)).ranges == ()  # an empty map: as before
    await add_shard(catalog, new_database, 0, 99)
    shard = await asyncpg.connect(new_database)
    try:
        await shard.execute("DELETE FROM schema_migrations WHERE version = 8; "
                            "DROP TABLE shard_ranges, shards, shard_map")  # a shard one migration behind
        shard_map = await prepare_role_database(database_url)
        assert shard_map.urls() == [new_database]
        assert await shard.fetchval("SELECT count(*) FROM schema_migrations") == len(migrations()) - 1
        await migrate_shards(shard_map)
        assert await shard.fetchval("SELECT count(*) FROM schema_migrations") == len(migrations())
    finally:
        await shard.close()


async def shards_command(*args: str) -> Result:
    return await asyncio.to_thread(CliRunner().invoke, cli, ["shards", *args], env={"COLUMNS": "200"})


async def test_shards_list_and_add(database_url: str, new_database: str) -> None:
    listed = await shards_command("list", "--database-url", database_url)
    assert listed.exit_code == 0, listed.output
    assert listed.output == "shard map version 0\n0-1023\tcatalog\t(the --database-url database)\n"

    added = await shards_command("add", new_database, "--partitions", "256-511", "--database-url", database_url)
    assert added.exit_code == 0, added.output
    assert "partitions 256-511 now live in shard 1" in added.output and "shard map version 1" in added.output

    listed = await shards_command("list", "--database-url", database_url)
    assert listed.output.splitlines() == [
        "shard map version 1", "0-255\tcatalog\t(the --database-url database)",
        f"256-511\tshard 1\t{without_password(new_database)}", "512-1023\tcatalog\t(the --database-url database)"]
    password = urlsplit(new_database).password
    assert password and password not in listed.output + added.output and ":***@" in listed.output

    for partitions, says in [("511-600", "overlap 256-511"), ("600", "must be FIRST-LAST"),
                             ("0-1024", "must lie within 0-1023")]:
        refused = await shards_command("add", new_database, "--partitions", partitions, "--database-url",
                                       database_url)
        assert refused.exit_code != 0 and says in refused.output, refused.output
    after = await shards_command("list", "--database-url", database_url)
    assert after.output == listed.output


async def config_command(*args: str) -> Result:
    return await asyncio.to_thread(CliRunner().invoke, cli, ["config", *args])


async def test_settings_are_copied_to_every_shard(catalog: asyncpg.Connection, database_url: str,
                                                  new_database: str) -> None:
    """The default failure webhook is read where a notification is queued, in the job's home: a shard
    gets the catalog's settings when it is added, and `chimes config` changes them everywhere."""
    async def on_shard() -> dict[str, object]:
        conn = await db.connect(new_database)
        try:
            return {r["key"]: r["value"] for r in await conn.fetch("SELECT key, value FROM settings")}
        finally:
            await conn.close()

    made = await config_command("set", "notify-url", "http://alerts.invalid/first", "--database-url", database_url)
    assert made.exit_code == 0, made.output
    await add_shard(catalog, new_database, 0, 511)
    assert await on_shard() == {"notify_url": "http://alerts.invalid/first"}
    changed = await config_command("set", "notify-url", "http://alerts.invalid/second", "--database-url", database_url)
    assert changed.exit_code == 0, changed.output
    assert await on_shard() == {"notify_url": "http://alerts.invalid/second"}
    assert await catalog.fetchval("SELECT value FROM settings WHERE key = 'notify_url'") == \
        "http://alerts.invalid/second"
    removed = await config_command("unset", "notify-url", "--database-url", database_url)
    assert removed.exit_code == 0, removed.output
    assert await on_shard() == {}
    assert await catalog.fetchval("SELECT count(*) FROM settings") == 0


async def test_a_shard_on_another_server(catalog: asyncpg.Connection, pool: asyncpg.Pool,
                                        second_server_dsn: str) -> None:
    name = f"chimes_far_{os.getpid()}_{next(_numbers)}"
    admin = await asyncpg.connect(second_server_dsn)
    await admin.execute(f"CREATE DATABASE {name}")
    far = with_database(second_server_dsn, name)
    try:
        assert await admin.fetchval("SELECT system_identifier FROM pg_control_system()") != \
            await catalog.fetchval("SELECT system_identifier FROM pg_control_system()")
        pools = ShardPools(pool, await load_map(catalog))
        try:
            assert await pools.refresh() is False  # nothing changed: the map is kept
            await add_shard(catalog, far, 0, 511)
            assert await pools.for_partition(3) is pool  # a process that has not looked yet
            assert await pools.refresh() is True and pools.map.version == 1
            far_pool = await pools.for_job(job_in(0, 511))
            assert await far_pool.fetchval("SELECT system_identifier FROM pg_control_system()") == \
                await admin.fetchval("SELECT system_identifier FROM pg_control_system()")
            assert await far_pool.fetchval("SELECT count(*) FROM partition_leases") == 1024  # migrated there
            assert await pools.for_job(job_in(512, 1023)) is pool
        finally:
            await pools.close()
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()


async def test_caps_and_shards_go_together(catalog: asyncpg.Connection, database_url: str,
                                           new_database: str) -> None:
    """Caps are counted across shards (slots in the catalog), so neither refuses the other; a bad
    target is still refused clearly."""
    await set_cap(catalog, Cap("owner", "team-a", "", 5))
    await add_shard(catalog, new_database, 0, 99)
    assert (await load_map(catalog)).version == 1

    def cap(*args: str) -> Result:
        return CliRunner().invoke(cli, ["cap", *args, "--database-url", database_url])

    added = await asyncio.to_thread(cap, "set", "tag:db-heavy", "2", "--owner", "team-b")
    assert added.exit_code == 0 and "tag:db-heavy of owner team-b: at most 2 running" in added.output, added.output
    assert await list_caps(catalog) == [Cap("owner", "team-a", "", 5), Cap("tag", "db-heavy", "team-b", 2)]
    for args, error in [(("set", "team-a", "5"), "must be owner:NAME or tag:NAME"),
                        (("set", "tag:db-heavy", "2"), "a tag cap needs --owner TEAM"),
                        (("set", "owner:team-a", "many"), "'many' is not a valid integer")]:
        refused = await asyncio.to_thread(cap, *args)
        assert refused.exit_code == 2 and error in refused.output, refused.output
    await remove_cap(catalog, "owner", "team-a", "")
    assert await list_caps(catalog) == [Cap("tag", "db-heavy", "team-b", 2)]
    # The shard's own table of caps stays empty: only the catalog's count.
    shard = await asyncpg.connect(new_database)
    try:
        assert await shard.fetchval("SELECT count(*) FROM concurrency_caps") == 0
    finally:
        await shard.close()
