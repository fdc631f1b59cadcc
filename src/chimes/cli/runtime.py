"""Running roles: the event loop, signals, the database, and uvicorn inside our own loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
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
    """uvicorn, without its own signal handling: the process decides when the API stops. The port is
    bound by :meth:`bind` before serving, so that a port in use is one clear error (uvicorn logs it
    and exits the interpreter); ``announce`` runs once the app has started and the port is served."""

    def __init__(self, config: uvicorn.Config, announce: Callable[[], None]) -> None:
        super().__init__(config)
        self._announce = announce
        self._socket: socket.socket | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def stop(self) -> None:
        self.should_exit = True

    def bind(self) -> None:
        """Take the port now; ApiBindError, naming it, when that cannot be done."""
        if self._socket is not None:
            return
        host, port = self.config.host, self.config.port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._socket = socket.create_server((host, port), family=family)
        except OSError as exc:
            raise ApiBindError(f"the API cannot listen on {host}:{port}: {exc.strerror or exc} (another process "
                               f"holds the port, or the address is not this host's: --host, --port)") from None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        if sockets is None:
            self.bind()
            assert self._socket is not None
            sockets = [self._socket]
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            self._announce()


class ApiBindError(RuntimeError):
    """The API's address cannot be bound (in use, or not this host's)."""


def api_server(app: Any, host: str, port: int, trusted_proxies: Sequence[str] = (),
               announce: Callable[[], None] | None = None) -> ApiServer:
    """uvicorn serving ``app``. The client address (what the failed-login limit counts by) comes from
    ``X-Forwarded-For`` only on connections from ``trusted_proxies``; with none, never. uvicorn on its
    own trusts 127.0.0.1 (or ``FORWARDED_ALLOW_IPS``): anyone on the host could then pick an address
    per request and never run out of failed logins. ``announce`` (default: log "API listening") runs
    once the port is served."""
    # log_config=None: uvicorn's own lines go through our handler (JSON lines off a terminal), not its own.
    # http="h11": uvicorn would take httptools wherever it is installed, which answers a method it does
    # not know with a bare 400 before the app, its metrics and logs, see it.
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, log_config=None,
                            http="h11", lifespan="on", timeout_graceful_shutdown=10,
                            timeout_keep_alive=API_KEEP_ALIVE_SEC, proxy_headers=bool(trusted_proxies),
                            forwarded_allow_ips=list(trusted_proxies))
    return ApiServer(config, announce or (lambda: log.info("API listening on http://%s:%d", host, port)))
