"""A scheduler or worker process's homes (chimes.cli.served_homes): they run together, one failing
stops the others and ends the process with its error, and a shard added to the map while they run
gets its roles within a second or two."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import asyncpg
import pytest

from chimes.cli.served_homes import Role, ServedHomes
from chimes.store import db
from chimes.store.shards import load_map
from tests.conftest import scratch_database
from tests.helpers import add_shards, wait_for

pytestmark = pytest.mark.own_shard_map  # databases and a shard map of its own, whatever --shards says


class Home:
    """Stands in for a home's node or worker (their own tests run them): runs until stopped, or fails."""

    def __init__(self, url: str, serves: frozenset[int] | None, fails_after: float | None = None) -> None:
        self.url = url
        self.serves = serves
        self.fails_after = fails_after
        self.stopping = asyncio.Event()
        self.finished = False

    async def run(self) -> None:
        if self.fails_after is not None:
            await asyncio.sleep(self.fails_after)
            raise RuntimeError("the shard's node failed")
        await self.stopping.wait()
        self.finished = True

    def stop(self) -> None:
        self.stopping.set()


@pytest.fixture
async def shard_url(server_dsn: str) -> AsyncIterator[str]:
    async with scratch_database(server_dsn, "chimes_served_shard") as dsn:
        yield dsn


async def give_half(database_url: str, shard_url: str) -> None:
    await add_shards(database_url, (shard_url, 0, 511))


async def test_one_failing_home_stops_the_others_and_its_error_ends_the_process(
    pool: asyncpg.Pool, database_url: str, shard_url: str
) -> None:
    await give_half(database_url, shard_url)
    started: list[Home] = []

    def start_home(home: db.Pool, url: str, serves: frozenset[int] | None, shard_id: int | None) -> list[Role]:
        started.append(Home(url, serves, fails_after=0.05 if url == shard_url else None))
        return [started[-1]]

    homes = ServedHomes(pool, database_url, await load_map(pool), start_home, pool_size=2)
    await homes.open()
    try:
        with pytest.raises(RuntimeError, match="the shard's node failed"):
            await asyncio.wait_for(homes.run(), timeout=10)
    finally:
        await homes.close()
    assert [h.url for h in started] == [database_url, shard_url]
    assert started[0].serves == frozenset(range(512, 1024)) and started[1].serves == frozenset(range(512))
    assert started[0].finished  # stopped the way a signal stops it, not cancelled


async def test_a_shard_added_while_running_gets_its_roles(pool: asyncpg.Pool, database_url: str,
                                                          shard_url: str) -> None:
    started: list[Home] = []
    catalog_serves: list[frozenset[int] | None] = []

    def start_home(home: db.Pool, url: str, serves: frozenset[int] | None, shard_id: int | None) -> list[Role]:
        started.append(Home(url, serves))
        return [started[-1]]

    homes = ServedHomes(pool, database_url, await load_map(pool), start_home, pool_size=2, follow_every_sec=0.1,
                        serves_changed=lambda roles, serves: catalog_serves.append(serves))
    await homes.open()
    running = asyncio.create_task(homes.run())
    try:
        await wait_for(lambda: len(started) == 1, timeout=5, what="the catalog's roles")
        assert started[0].serves is None  # no shards: it serves every partition
        await give_half(database_url, shard_url)
        await wait_for(lambda: len(started) == 2, timeout=5, what="the new shard's roles")
        assert started[1].url == shard_url and started[1].serves == frozenset(range(512))
        assert catalog_serves == [frozenset(range(512, 1024))]
        assert len(homes.pools()) == 2
        homes.stop()
        await asyncio.wait_for(running, timeout=5)
    finally:
        homes.stop()
        await asyncio.gather(running, return_exceptions=True)
        await homes.close()
    assert all(h.finished for h in started)


async def test_a_shard_that_does_not_answer_holds_up_no_other_and_is_served_once_it_does(
    pool: asyncpg.Pool, database_url: str, shard_url: str, server_dsn: str
) -> None:
    await give_half(database_url, shard_url)
    name = urlsplit(shard_url).path.lstrip("/")
    admin = await asyncpg.connect(server_dsn)
    started: list[Home] = []

    def start_home(home: db.Pool, url: str, serves: frozenset[int] | None, shard_id: int | None) -> list[Role]:
        started.append(Home(url, serves))
        return [started[-1]]

    try:
        await admin.execute(f"DROP DATABASE {name} WITH (FORCE)")  # the shard is gone (a lost server, say)
        homes = ServedHomes(pool, database_url, await load_map(pool), start_home, pool_size=2,
                            follow_every_sec=0.1)
        await asyncio.wait_for(homes.open(), timeout=10)  # one try, not --database-wait
        running = asyncio.create_task(homes.run())
        try:
            await wait_for(lambda: len(started) == 1, timeout=5, what="the catalog's roles")
            assert started[0].url == database_url
            await asyncio.sleep(0.5)  # several tries of the shard, none of them holding anything up
            assert len(started) == 1 and not running.done()
            await admin.execute(f"CREATE DATABASE {name}")  # back, empty: migrated before its roles start
            await wait_for(lambda: len(started) == 2, timeout=10, what="the shard's roles once it answers")
            assert started[1].url == shard_url
            migrated = await asyncpg.connect(shard_url)
            try:
                assert await migrated.fetchval("SELECT count(*) FROM partition_leases") == 1024
            finally:
                await migrated.close()
        finally:
            homes.stop()
            await asyncio.gather(running, return_exceptions=True)
            await homes.close()
    finally:
        await admin.close()
