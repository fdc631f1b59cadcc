"""Small helpers for tests: waiting on conditions with deadlines, moving stored times into the past,
ports, auth headers."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import asyncpg
from aiohttp import web

from chimes.ids import partition_of, partition_of_key, scheduled_at_of
from chimes.store import db
from chimes.store.shards import ShardPools, add_shard


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def auth_as(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def wait_for(
    condition: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.05
) -> Any:
    """Poll ``condition`` (sync or async) until it returns something truthy, or fail after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = condition()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return result
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def _updated(tag: str) -> int:
    return int(tag.split()[-1])


async def _every_home(pool: asyncpg.Pool | Homes) -> list[asyncpg.Pool]:
    """A run id does not name its job's home: statements by run id go to every home."""
    return await pool.homes() if isinstance(pool, Homes) else [pool]


# The runs of a claim share its lease row (claim_leases): a run to be moved on the clock alone gets
# a lease row of its own first, a copy of its claim's, which overrides the claim's (migration 0015).
_OWN_LEASES = """
INSERT INTO run_leases (run_id, scheduled_at, partition_id, token, expires_at, deadline_at)
SELECT l.run_id, l.scheduled_at, r.partition_id, l.token, l.expires_at, l.deadline_at
FROM leases_in_force l JOIN runs r ON r.run_id = l.run_id AND r.scheduled_at = l.scheduled_at
WHERE r.status = 'running' AND r.lease_token = l.token
  AND (l.run_id, l.scheduled_at) IN (SELECT * FROM unnest($1::uuid[], $2::timestamptz[]))
ON CONFLICT (run_id) DO NOTHING
"""


async def expire_run_lease(pool: asyncpg.Pool | Homes, run_id: uuid.UUID) -> None:
    """Time control instead of a sleep: the running run's lease ends now on the database's clock, the
    clock the reaper judges by, as if its worker had stopped heartbeating. Only this run is touched."""
    updated = 0
    for home in await _every_home(pool):
        await home.execute(_OWN_LEASES, [run_id], [scheduled_at_of(run_id)])
        updated += _updated(await home.execute(
            "UPDATE run_leases SET expires_at = now() - interval '1 millisecond'"
            " WHERE run_id = $1 AND scheduled_at = $2", run_id, scheduled_at_of(run_id)))
    assert updated == 1, f"run {run_id} is not running: no lease to expire"


async def let_time_pass_for_runs(pool: asyncpg.Pool | Homes, run_ids: Iterable[uuid.UUID], seconds: float) -> None:
    """Time control instead of a sleep: to the reaper, ``seconds`` pass for these running runs (their
    lease and deadline move that far into the past on the database's clock), and for no other."""
    ids = list(run_ids)
    updated = 0
    for home in await _every_home(pool):
        await home.execute(_OWN_LEASES, ids, [scheduled_at_of(i) for i in ids])
        updated += _updated(await home.execute(
            "UPDATE run_leases SET expires_at = expires_at - make_interval(secs => $3),"
            " deadline_at = deadline_at - make_interval(secs => $3)"
            " WHERE (run_id, scheduled_at) IN (SELECT * FROM unnest($1::uuid[], $2::timestamptz[]))",
            ids, [scheduled_at_of(i) for i in ids], seconds))
    assert updated == len(ids), f"not all of {ids} are running ({updated} updated)"


@contextlib.asynccontextmanager
async def http_server(handle: Callable[[web.Request], Awaitable[web.StreamResponse]],
                      host: str = "127.0.0.1") -> AsyncIterator[str]:
    """A real HTTP server on ``host`` that answers every method and path with ``handle``; yields its URL."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    try:
        yield f"http://{host}:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


class FailsOnce:
    """Wraps a store method: the first call raises ``error``, later calls go through to the real
    database. A failure that cannot be produced on demand (a driver race, a bug) stands in this way."""

    def __init__(self, method: Callable[..., Awaitable[Any]], error: Exception) -> None:
        self.method = method
        self.error = error
        self.calls = 0

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            raise self.error
        return await self.method(*args, **kwargs)


class Homes(ShardPools):
    """The pools of every database of a test's shard map (``pytest --shards N``; one database
    otherwise), with reads that span them: rows live in their job's home."""

    async def for_job(self, job_id: uuid.UUID | str) -> asyncpg.Pool:
        """The pool of the job's home (its runs' too); the id as a UUID or a string."""
        return await super().for_job(uuid.UUID(str(job_id)))

    async def fetch(self, query: str, *args: object) -> list[asyncpg.Record]:
        """The rows of ``query`` from every home, the catalog's first."""
        return [row for home in await self.homes() for row in await home.fetch(query, *args)]

    async def total(self, query: str, *args: object) -> int:
        """The sum of ``query``'s single value (a count) over every home."""
        return sum([int(await home.fetchval(query, *args) or 0) for home in await self.homes()])

    def home_of(self, job_id: uuid.UUID | str) -> int:
        """Which home a job's partition is in: 0 for the catalog, else its shard's id."""
        shard_range = self.map.range_of(partition_of(uuid.UUID(str(job_id))))
        return 0 if shard_range is None else shard_range.shard_id

    def key_beside(self, owner: str, job_id: uuid.UUID | str) -> str:
        """An Idempotency-Key that puts ``owner``'s new job in the same home as ``job_id`` (and so under
        the same scheduler node and claim loop)."""
        home = self.home_of(job_id)
        for number in range(100_000):
            key = f"beside-{number}"
            shard_range = self.map.range_of(partition_of_key(owner, key))
            if (0 if shard_range is None else shard_range.shard_id) == home:
                return key
        raise AssertionError(f"no key of {owner} lands beside {job_id}")

    async def fetchval_anywhere(self, query: str, *args: object) -> Any:
        """The first non-null value of ``query`` in any home (a row found by run id, which does not name
        its home)."""
        for home in await self.homes():
            value = await home.fetchval(query, *args)
            if value is not None:
                return value
        return None

    async def fetchrow(self, job_id: uuid.UUID | str, query: str, *args: object) -> asyncpg.Record | None:
        """One row of ``query`` from the home of ``job_id``."""
        return await (await self.for_job(job_id)).fetchrow(query, *args)

    async def fetchval(self, job_id: uuid.UUID | str, query: str, *args: object) -> Any:
        """One value of ``query`` from the home of ``job_id``."""
        return await (await self.for_job(job_id)).fetchval(query, *args)


async def add_shards(catalog_url: str, *ranges: tuple[str, int, int]) -> None:
    """What `chimes shards add URL --partitions FIRST-LAST` does, for each (URL, first, last) in turn,
    on the catalog at ``catalog_url``."""
    conn = await db.connect(catalog_url)
    try:
        for url, first, last in ranges:
            await add_shard(conn, url, first, last)
    finally:
        await conn.close()
