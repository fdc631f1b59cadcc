"""Running roles: the event loop, signals, the database, and uvicorn inside our own loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import uvicorn

from chimes.settings import API_KEEP_ALIVE_SEC, Settings
from chimes.store import db, shards
from chimes.store.migrate import migrate

log = logging.getLogger("chimes")

T = TypeVar("T")


def run_async(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine on uvloop when available (it is markedly faster for this workload)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - platforms without uvloop
        return asyncio.run(main())
    return uvloop.run(main())


def on_shutdown_signals(stop: Callable[[], None]) -> None:
    """SIGTERM and SIGINT ask for a graceful stop; a second one is not special (the stop is idempotent)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)


async def migrate_database(dsn: str) -> list[int]:
    """Apply pending migrations; each runs in its own transaction, so a restart midway is tried again."""
    return await db.with_connection(dsn, migrate)


async def prepare_role_database(dsn: str) -> shards.ShardMap:
    """Migrate the catalog and read its shard map. A scheduler or worker migrates each shard when it
    first serves it (chimes.cli.served_homes); an API process calls :func:`migrate_shards`."""
    await migrate_database(dsn)
    return await db.with_connection(dsn, shards.load_map)


async def migrate_shards(shard_map: shards.ShardMap) -> None:
    """Migrate every shard of the map that answers, one try each: a shard that is down holds up no
    other, and is migrated by the roles that serve it once it answers (docs/scaling.md, "Shards")."""
    for url in shard_map.urls():
        try:
            await db.with_connection(url, migrate, wait_sec=0)
        except db.DB_ERRORS as exc:
            log.warning("shard %s does not answer (%s): its jobs are served once it does",
                        shards.without_password(url), db.describe(exc).splitlines()[0])


def on_migrated_database(settings: Settings, action: Callable[[db.Connection], Awaitable[T]]) -> T:
    """Run ``action`` once on a connection to the configured database (with shards: the catalog),
    migrated first: what the CLI's administrative commands (caps, shards) do."""
    async def main(dsn: str) -> T:
        await migrate_database(dsn)
        conn = await db.connect(dsn)
        try:
            return await action(conn)
        finally:
            await conn.close()

    with db.database_url(settings) as dsn:
        return asyncio.run(main(dsn))


class ApiServer(uvicorn.Server):
    """uvicorn, without its own signal handling: the process decides when the API stops."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def stop(self) -> None:
        self.should_exit = True


def api_server(app: Any, host: str, port: int, trusted_proxies: Sequence[str] = ()) -> ApiServer:
    """uvicorn serving ``app``. The client address (what the failed-login limit counts by) comes from
    ``X-Forwarded-For`` only on connections from ``trusted_proxies``; with none, never. uvicorn on its
    own trusts 127.0.0.1 (or ``FORWARDED_ALLOW_IPS``): anyone on the host could then pick an address
    per request and never run out of failed logins."""
    # log_config=None: uvicorn's own lines go through our handler (JSON lines off a terminal), not its own.
    # http="h11": uvicorn would take httptools wherever it is installed, which answers a method it does
    # not know with a bare 400 before the app, its metrics and logs, see it.
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, log_config=None,
                            http="h11", lifespan="on", timeout_graceful_shutdown=10,
                            timeout_keep_alive=API_KEEP_ALIVE_SEC, proxy_headers=bool(trusted_proxies),
                            forwarded_allow_ips=list(trusted_proxies))
    return ApiServer(config)
