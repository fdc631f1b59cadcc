"""Shared fixtures: one real PostgreSQL per test session, a fresh database per test.

The server is the embedded one (started here, in a temporary folder) unless CHIMES_DATABASE_URL
points at another. Each test gets its own database, copied from a migrated template, which is much
faster than migrating per test and keeps tests independent.

``pytest --shards N`` (N > 1) runs the suite sharded: ``database_url`` is then a catalog whose map
gives the 1,024 partitions, split evenly, to itself and N-1 shard databases on other embedded
servers, fresh for each test like the catalog. The API, the ``processes`` and the ``fleet`` see it
through the map; tests that read rows directly use ``homes``. Tests marked ``single_database`` (about
one database's statements or internals), tests marked ``own_shard_map`` and tests that use no database
are deselected then.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
from collections.abc import AsyncIterator, Iterator, Sequence
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx
import pytest

from chimes.api.app import create_app
from chimes.cli.runtime import api_server
from chimes.ids import PARTITION_COUNT
from chimes.store import db
from chimes.store.embedded import embedded_server_for_a_while, server_for_a_while
from chimes.store.migrate import migrate
from chimes.store.shards import add_shard, load_map
from chimes.store.tokens import create_token
from tests.helpers import Homes, auth_as, wait_for

pytest_plugins = ["tests.target", "tests.integration.fleet", "tests.e2e.processes", "tests.podman_runtime"]

TEMPLATE = f"chimes_template_{os.getpid()}"
_numbers = itertools.count()
MAX_SHARDS = 8  # homes in all, the catalog included


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--first-pass", action="store_true", default=False,
                     help="deselect the tests marked long or sharded_pass, which the second tier runs instead "
                          "(scripts/test --second-tier)")
    parser.addoption("--shards", type=int, default=1, metavar="N",
                     help="run each test's database_url as a catalog with N-1 shards on other embedded PostgreSQL "
                          "servers, the partitions split evenly (default 1: one database); deselects tests marked "
                          "single_database and tests that use no database")


def pytest_configure(config: pytest.Config) -> None:
    shards = config.getoption("--shards")
    if not 1 <= shards <= MAX_SHARDS:
        raise pytest.UsageError(f"--shards must be between 1 and {MAX_SHARDS}, not {shards}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under --shards N > 1, keep only the tests the map can change: those on ``database_url``
    (directly or through the API, the processes, the fleet), not marked single_database (about one
    database) or own_shard_map (they build their own map on one database either way), and the tests
    marked sharded_pass, which run there whatever they use. With --first-pass (scripts/test), leave
    those out, and the long drills: the second tier (scripts/test --second-tier) runs them."""
    sharded = config.getoption("--shards") > 1
    if not sharded and not config.getoption("--first-pass"):
        return
    kept, dropped = [], []
    for item in items:
        second = item.get_closest_marker("sharded_pass") is not None
        if sharded:
            on_database = "database_url" in getattr(item, "fixturenames", ())
            marked = any(item.get_closest_marker(name) for name in ("single_database", "own_shard_map"))
            keep = second or (on_database and not marked)
        else:
            keep = not second and item.get_closest_marker("long") is None
        (kept if keep else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(scope="session")
def shard_count(request: pytest.FixtureRequest) -> int:
    """How many homes each test's ``database_url`` has: 1 (one database) unless --shards N."""
    count: int = request.config.getoption("--shards")
    return count


def even_ranges(homes: int) -> list[tuple[int, int]]:
    """The 1,024 partitions split into ``homes`` ranges as even as can be, first to last."""
    bounds = [home * PARTITION_COUNT // homes for home in range(homes + 1)]
    return [(bounds[home], bounds[home + 1] - 1) for home in range(homes)]


def with_database(dsn: str, name: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


@pytest.fixture(scope="session")
def server_dsn() -> Iterator[str]:
    with server_for_a_while("chimes-test-pg-") as dsn:
        yield dsn


@pytest.fixture(scope="session")
def second_server_dsn() -> Iterator[str]:
    """A PostgreSQL server of its own, beside the session's, always embedded: a shard on another
    machine (docs/scaling.md, "Shards")."""
    with embedded_server_for_a_while("chimes-test-shard-pg-") as dsn:
        yield dsn


@pytest.fixture(scope="session")
def third_server_dsn() -> Iterator[str]:
    """Another embedded PostgreSQL server, for the third home of ``--shards 3``."""
    with embedded_server_for_a_while("chimes-test-shard-pg-") as dsn:
        yield dsn


@contextlib.asynccontextmanager
async def migrated_template(server_dsn: str) -> AsyncIterator[str]:
    """A migrated template database on the server, dropped afterwards."""
    admin = await asyncpg.connect(server_dsn)
    await admin.execute(f"DROP DATABASE IF EXISTS {TEMPLATE}")
    await admin.execute(f"CREATE DATABASE {TEMPLATE}")
    dsn = with_database(server_dsn, TEMPLATE)
    conn = await asyncpg.connect(dsn)
    await migrate(conn)
    await conn.close()
    try:
        yield dsn
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {TEMPLATE} WITH (FORCE)")
        await admin.close()


@pytest.fixture(scope="session")
async def template_dsn(server_dsn: str) -> AsyncIterator[str]:
    async with migrated_template(server_dsn) as dsn:
        yield dsn


@pytest.fixture(scope="session")
async def test_databases(server_dsn: str, template_dsn: str) -> AsyncIterator[FreshDatabases]:
    databases = FreshDatabases(server_dsn, "chimes_test")
    yield databases
    await databases.close()


@pytest.fixture(scope="session")
async def shard_servers(request: pytest.FixtureRequest, shard_count: int) -> AsyncIterator[list[FreshDatabases]]:
    """Under --shards N, the servers the shards go on, each with a migrated template: the second
    server, and the third when there are two shards or more (shards beyond take turns)."""
    if shard_count == 1:
        yield []
        return
    names = ["second_server_dsn", "third_server_dsn"][:shard_count - 1]
    servers = [request.getfixturevalue(name) for name in names]
    async with contextlib.AsyncExitStack() as stack:
        databases = []
        for server in servers:
            await stack.enter_async_context(migrated_template(server))
            databases.append(FreshDatabases(server, "chimes_test_shard"))
            stack.push_async_callback(databases[-1].close)
        yield databases


# Servers of tests that are over, still shutting down: a database is dropped only after them.
_closing: set[asyncio.Task[None]] = set()
# Bound at import: a test may replace asyncpg.connect to count or break its own connections.
_connect = asyncpg.connect


class FreshDatabases:
    """Copies of the migrated template on one server, one for each test: the next copy is made while
    a test runs and each is dropped after its test without the next test waiting for it, so neither
    is on a test's time."""

    def __init__(self, server_dsn: str, prefix: str) -> None:
        self._server_dsn, self._prefix = server_dsn, prefix
        self._ahead: asyncio.Task[str] | None = None
        self._drops: set[asyncio.Task[None]] = set()
        self.held = False  # no copy made ahead while a test that measures the server runs

    async def _execute(self, statement: str) -> None:
        admin = await _connect(self._server_dsn)
        try:
            await admin.execute(statement)
        finally:
            await admin.close()

    async def _create(self) -> str:
        name = f"{self._prefix}_{os.getpid()}_{next(_numbers)}"
        await self._execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
        return name

    async def _drop(self, name: str, after: Sequence[asyncio.Task[None]] = ()) -> None:
        await asyncio.gather(*after, return_exceptions=True)
        await self._execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    @contextlib.asynccontextmanager
    async def fresh(self) -> AsyncIterator[str]:
        """A database of the test's own, dropped once the test is over."""
        ahead, self._ahead = self._ahead, None
        try:
            # made ahead, unless its server was stopped or restarted since (a test may do that)
            name = await ahead if ahead is not None else await self._create()
        except (OSError, asyncpg.PostgresError):
            name = await self._create()
        if not self.held:
            self._ahead = asyncio.create_task(self._create())
        try:
            yield with_database(self._server_dsn, name)
        finally:
            drop = asyncio.create_task(self._drop(name, after=tuple(_closing)))
            self._drops.add(drop)
            drop.add_done_callback(self._drops.discard)

    async def settle(self) -> None:
        """Wait for the copy made ahead, the drops and the servers' shutdowns under way."""
        if self._ahead is not None:
            await asyncio.wait([self._ahead])
        await asyncio.gather(*_closing, *self._drops, return_exceptions=True)

    async def close(self) -> None:
        """Wait for the drops under way, and drop the copy made ahead."""
        if self._ahead is not None:
            with contextlib.suppress(OSError, asyncpg.PostgresError):
                await self._drop(await self._ahead)
        await asyncio.gather(*_closing, *self._drops, return_exceptions=True)


@contextlib.asynccontextmanager
async def scratch_database(server_dsn: str, prefix: str, template: str | None = None) -> AsyncIterator[str]:
    """A database of its own on the server (a copy of ``template``, or empty), dropped afterwards."""
    name = f"{prefix}_{os.getpid()}_{next(_numbers)}"
    admin = await asyncpg.connect(server_dsn)
    await admin.execute(f"CREATE DATABASE {name}" + (f" TEMPLATE {template}" if template else ""))
    try:
        yield with_database(server_dsn, name)
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()


@pytest.fixture
async def quiet_server(test_databases: FreshDatabases, shard_servers: list[FreshDatabases]) -> AsyncIterator[None]:
    """For a test that measures the servers (their WAL, the pages its rows land on): no database is
    copied or dropped on them while it runs, which would write WAL and hold back the cleanup of old
    row versions."""
    every = [test_databases, *shard_servers]
    for databases in every:
        databases.held = True
    for databases in every:
        await databases.settle()
    yield
    for databases in every:
        databases.held = False


@pytest.fixture
async def single_database_url(test_databases: FreshDatabases) -> AsyncIterator[str]:
    """A fresh, migrated database for this test alone, with an empty shard map whatever --shards says."""
    async with test_databases.fresh() as dsn:
        yield dsn


@pytest.fixture
async def database_url(request: pytest.FixtureRequest, single_database_url: str, shard_count: int,
                       shard_servers: list[FreshDatabases]) -> AsyncIterator[str]:
    """The test's database: with one home (the default), ``single_database_url``; under --shards N, that
    database as the catalog, its map giving even ranges of the partitions to N-1 fresh shard
    databases (the catalog keeps the first range), dropped after the test like the catalog. A test
    marked own_shard_map (run there only when also marked sharded_pass) builds its own map: it gets
    the one database."""
    if shard_count == 1 or request.node.get_closest_marker("own_shard_map") is not None:
        yield single_database_url
        return
    ranges = even_ranges(shard_count)
    async with contextlib.AsyncExitStack() as stack:
        catalog = await db.connect(single_database_url)
        stack.push_async_callback(catalog.close)
        for number, (first, last) in enumerate(ranges[1:]):
            shard = await stack.enter_async_context(shard_servers[number % len(shard_servers)].fresh())
            await add_shard(catalog, shard, first, last)
        await catalog.close()
        yield single_database_url


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await db.create_pool(database_url, max_size=8)
    yield pool
    # A connection still checked out at the end of a test is a leak in the code under test.
    assert pool.get_size() - pool.get_idle_size() == 0, "connections left checked out"
    await pool.close()


@pytest.fixture
async def homes(pool: asyncpg.Pool) -> AsyncIterator[Homes]:
    """The pools of every database of the test's map, for tests that read or write rows directly:
    ``await homes.for_job(job_id)`` is the job's (its runs' too), ``await homes.homes()`` all of them,
    the catalog's (``pool``) first; ``homes.fetch`` and ``homes.total`` read them all. With one
    database, every job's home is ``pool``."""
    pools = Homes(pool, await load_map(pool), max_size=4)
    yield pools
    await pools.close()


@pytest.fixture
async def tokens(pool: asyncpg.Pool) -> dict[str, str]:
    async with pool.acquire() as conn:
        return {
            "admin": await create_token(conn, "admin", admin=True),
            "team-a": await create_token(conn, "team-a"),
            "team-b": await create_token(conn, "team-b"),
        }


@pytest.fixture
async def api_url(database_url: str) -> AsyncIterator[str]:
    """The real API served by uvicorn on 127.0.0.1, in this test's event loop."""
    # Bound here and handed over, so no other process can take the port in between.
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = api_server(create_app(database_url, pool_size=4), "127.0.0.1", port)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await wait_for(lambda: server.started or task.done(), timeout=10, what="API start")
    assert server.started, "the API did not start"
    yield f"http://127.0.0.1:{port}"
    server.stop()
    # uvicorn's shutdown waits out its ticks; the next test need not wait with it (its database is
    # dropped once it is done, FreshDatabases).
    closing = asyncio.create_task(_closed(task, sock))
    _closing.add(closing)
    closing.add_done_callback(_closing.discard)


async def _closed(serving: asyncio.Task[None], sock: socket.socket) -> None:
    try:
        await serving
    finally:
        sock.close()


@pytest.fixture
async def client(api_url: str, tokens: dict[str, str]) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client for team-a; pass other tokens per request with ``auth_as``."""
    # verify=False: plain HTTP, so no certificate store to load for every test
    async with httpx.AsyncClient(base_url=api_url, headers=auth_as(tokens["team-a"]), timeout=30,
                                 verify=False) as http:
        yield http



