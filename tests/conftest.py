"""Shared fixtures: one real PostgreSQL per test session, a fresh database per test.

The server is the embedded one (started here, in a temporary folder) unless CHIMES_DATABASE_URL
points at another. Each test gets its own database, copied from a migrated template, which is much
faster than migrating per test and keeps tests independent.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx
import pytest

from chimes.api.app import create_app
from chimes.cli.runtime import api_server
from chimes.store import db
from chimes.store.embedded import EmbeddedPostgres, server_for_a_while
from chimes.store.migrate import migrate
from chimes.store.tokens import create_token
from tests.helpers import auth_as, wait_for

pytest_plugins = ["tests.target", "tests.integration.fleet", "tests.e2e.processes", "tests.podman_runtime"]

TEMPLATE = f"chimes_template_{os.getpid()}"
_numbers = itertools.count()


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
    folder = Path(tempfile.mkdtemp(prefix="chimes-test-shard-pg-"))
    server = EmbeddedPostgres(folder)
    try:
        yield server.acquire()
    finally:
        server.release()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
async def template_dsn(server_dsn: str) -> AsyncIterator[str]:
    admin = await asyncpg.connect(server_dsn)
    await admin.execute(f"DROP DATABASE IF EXISTS {TEMPLATE}")
    await admin.execute(f"CREATE DATABASE {TEMPLATE}")
    dsn = with_database(server_dsn, TEMPLATE)
    conn = await asyncpg.connect(dsn)
    await migrate(conn)
    await conn.close()
    yield dsn
    await admin.execute(f"DROP DATABASE IF EXISTS {TEMPLATE} WITH (FORCE)")
    await admin.close()


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
async def database_url(server_dsn: str, template_dsn: str) -> AsyncIterator[str]:
    """A fresh, migrated database for this test alone."""
    async with scratch_database(server_dsn, "chimes_test", TEMPLATE) as dsn:
        yield dsn


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await db.create_pool(database_url, max_size=8)
    yield pool
    # A connection still checked out at the end of a test is a leak in the code under test.
    assert pool.get_size() - pool.get_idle_size() == 0, "connections left checked out"
    await pool.close()


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
    await task
    sock.close()


@pytest.fixture
async def client(api_url: str, tokens: dict[str, str]) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client for team-a; pass other tokens per request with ``auth_as``."""
    async with httpx.AsyncClient(base_url=api_url, headers=auth_as(tokens["team-a"]), timeout=30) as http:
        yield http



