"""The databases a scheduler or worker process serves, one set of roles per home, following the shard
map while it runs (docs/scaling.md, "Shards").

A process starts with the catalog and every shard the map names. Every second it reads the map's
version (one primary-key read on the catalog); when a shard was added it migrates it, opens a pool
there and starts that home's roles, so `chimes shards add` needs no restart of the fleet. A shard
that does not answer (at start, or when added) does not hold up the others: it is tried again every
second, and its roles start once it answers. One home's role that fails stops every other and the
process exits with its error, as with one database.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from chimes.store import db
from chimes.store.migrate import migrate
from chimes.store.queries import sql
from chimes.store.shards import ShardMap, load_map, without_password

log = logging.getLogger("chimes")
FOLLOW_MAP_SEC = 1.0


class Role(Protocol):
    def run(self) -> Coroutine[Any, Any, None]: ...

    def stop(self) -> None: ...


# Makes one home's roles: its pool, its URL, the partitions it holds (None: every partition, the
# database of a fleet without shards), and its shard id (None: the catalog).
StartHome = Callable[[db.Pool, str, frozenset[int] | None, int | None], list[Role]]
# Tells a running home's roles which partitions it holds now (the map changed).
ServesChanged = Callable[[list[Role], frozenset[int] | None], None]


def served(shard_map: ShardMap) -> list[tuple[str, frozenset[int] | None]]:
    """Each home's URL key ("" for the catalog) and partitions, catalog first; None without shards."""
    if not shard_map.ranges:
        return [("", None)]
    homes = shard_map.homes()
    return [("", homes[0][1]), *zip(shard_map.urls(), (held for _, held in homes[1:]), strict=True)]


class ServedHomes:
    def __init__(self, catalog: db.Pool, catalog_url: str, shard_map: ShardMap, start_home: StartHome, *,
                 pool_size: int, server_settings: dict[str, str] | None = None,
                 serves_changed: ServesChanged | None = None, follow_every_sec: float = FOLLOW_MAP_SEC) -> None:
        self._catalog = catalog
        self._catalog_url = catalog_url
        self._map = shard_map
        self._start_home = start_home
        self._pool_size = pool_size
        self._server_settings = server_settings
        self._serves_changed = serves_changed
        self._follow_every_sec = follow_every_sec
        self._roles: dict[str, list[Role]] = {}  # by home: "" the catalog, else the shard's URL
        self._pools: dict[str, db.Pool] = {}  # the shards' pools, opened here
        self._unreachable: set[str] = set()  # shards whose last try failed (logged once)
        self._follow_failing = False  # the last read of the map failed (logged once)
        self._tasks: list[asyncio.Future[None]] = []
        self._stopping = asyncio.Event()
        self._error: BaseException | None = None

    async def open(self) -> None:
        """Migrate every shard of the map and open a pool on it, one try each: those that do not answer
        are tried again every second once :meth:`run` runs (the catalog answered already)."""
        try:
            for url in self._map.urls():
                await self._open_home(url)
        except BaseException:
            await self.close()
            raise

    def pools(self) -> list[db.Pool]:
        return [self._catalog, *self._pools.values()]

    async def run(self) -> None:
        """Run every home's roles until :meth:`stop`, or until one fails: then stop the others, let
        them finish, and raise its error."""
        for key, serves in served(self._map):
            if key == "" or key in self._pools:
                self._start(key, serves)
        follower = asyncio.create_task(self._follow())
        try:
            await self._stopping.wait()
        finally:
            follower.cancel()
            self._stop_roles()
            await asyncio.gather(follower, *self._tasks, return_exceptions=True)
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        self._stopping.set()
        self._stop_roles()

    async def close(self) -> None:
        """Close the shards' pools (the catalog's is the caller's)."""
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await pool.close()

    def _stop_roles(self) -> None:
        for roles in self._roles.values():
            for role in roles:
                role.stop()

    def _start(self, key: str, serves: frozenset[int] | None) -> None:
        if key == "":
            roles = self._start_home(self._catalog, self._catalog_url, serves, None)
        else:
            shard_id = next(r.shard_id for r in self._map.ranges if r.url == key)
            roles = self._start_home(self._pools[key], key, serves, shard_id)
        self._roles[key] = roles
        for role in roles:
            task = asyncio.ensure_future(role.run())
            task.add_done_callback(self._ended)
            self._tasks.append(task)

    def _ended(self, task: asyncio.Future[None]) -> None:
        error = None if task.cancelled() else task.exception()
        if error is not None and self._error is None:
            self._error = error
            self._stopping.set()

    async def _follow(self) -> None:
        while not self._stopping.is_set():
            await asyncio.sleep(self._follow_every_sec)
            try:
                await self._follow_once()
            except Exception as exc:  # the catalog unreachable, say: try again next second, say so once
                if not self._follow_failing:
                    log.warning("could not read the shard map: %s", db.describe(exc).splitlines()[0])
                self._follow_failing = True
            else:
                if self._follow_failing:
                    log.info("reading the shard map again")
                self._follow_failing = False

    async def _follow_once(self) -> None:
        changed = await self._catalog.fetchval(sql("shard_map_version")) != self._map.version
        if changed:
            self._map = await load_map(self._catalog)
            log.info("shard map version %d: %d ranges", self._map.version, len(self._map.ranges))
        for key, serves in served(self._map):
            if self._stopping.is_set():
                return
            if key not in self._roles:
                if key not in self._pools and not await self._open_home(key):
                    continue  # not answering yet: next second
                log.info("serving a new shard (map version %d)", self._map.version)
                self._start(key, serves)
            elif changed and self._serves_changed is not None:
                self._serves_changed(self._roles[key], serves)

    async def _open_home(self, url: str) -> bool:
        """Migrate the shard at ``url`` and open its pool, one try: False (logged) when it does not answer."""
        try:
            await db.with_connection(url, migrate, wait_sec=0)
            self._pools[url] = await db.create_pool(
                url, max_size=self._pool_size, server_settings=self._server_settings, wait_sec=0,
                command_timeout=db.command_timeout(db.ROLE_COMMAND_TIMEOUT_SEC))
        except db.DB_ERRORS as exc:
            if url not in self._unreachable:
                log.warning("shard %s does not answer (%s): serving the others, trying it again every second",
                            without_password(url), db.describe(exc).splitlines()[0])
                self._unreachable.add(url)
            return False
        self._unreachable.discard(url)
        return True
