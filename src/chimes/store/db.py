"""Connecting to PostgreSQL: the pool every role uses, and the embedded server behind it by default."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, TypeVar
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import asyncpg.pool
import orjson

from chimes import outage, settings
from chimes.settings import Settings
from chimes.store.embedded import Archiving, EmbeddedPostgres
from chimes.store.queries import sql

log = logging.getLogger("chimes.db")
T = TypeVar("T")

# The driver's types under the store's names: code above the store types a pool or a connection, and
# catches a database error, with these, and never imports the driver itself.
Pool = asyncpg.Pool
Connection = asyncpg.Connection
Record = asyncpg.Record
Transaction = asyncpg.transaction.Transaction
DatabaseError = asyncpg.PostgresError  # an error the server answered with
LockNotAvailable = asyncpg.LockNotAvailableError  # lock_timeout: the lock was held by someone else

# What pool.acquire() lends is a proxy that forwards every call to a connection, not a Connection
# itself: a function that only runs statements takes a Conn, so that either kind will do.
Conn: TypeAlias = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy


class Row(Protocol):
    """A row as read, for code that only looks up its columns by name (rendering, logging): what the
    store hands out where converting every row to a dataclass would cost more than it tells."""

    def __getitem__(self, key: str, /) -> Any: ...

    def keys(self) -> Iterator[str]: ...  # so that dict(row) makes a copy


def one_row(row: asyncpg.Record | None) -> asyncpg.Record:
    """The row of a statement that always returns one (an aggregate, an upsert with RETURNING): none
    means the statement is not what the caller takes it for, which is a bug to report, not to skip."""
    if row is None:
        raise LookupError("a statement that always returns a row returned none")
    return row

_JSONB_VERSION = b"\x01"  # the binary jsonb format is a version byte, then the JSON text


def _encode_jsonb(value: Any) -> bytes:
    return _JSONB_VERSION + orjson.dumps(value)


def _decode_jsonb(data: bytes) -> Any:
    return orjson.loads(data[1:])


async def _init_connection(conn: asyncpg.Connection) -> None:
    # Binary codecs: faster than text, and COPY (bulk import) needs them.
    await conn.set_type_codec("jsonb", encoder=_encode_jsonb, decoder=_decode_jsonb, schema="pg_catalog",
                              format="binary")
    await conn.set_type_codec("json", encoder=orjson.dumps, decoder=orjson.loads, schema="pg_catalog",
                              format="binary")


# The batch statements (fire, claim, complete, reap) take arrays of a few to a thousand rows. Only a
# custom plan sees their length; the generic plan PostgreSQL switches a prepared statement to after
# five executions guesses it, and for a large batch its guess makes the statement several times
# slower. Planning each time costs little beside that.
SESSION_SETTINGS = {"plan_cache_mode": "force_custom_plan"}


def lock_holding_limit(seconds: float) -> dict[str, str]:
    """Server settings ending a session left idle inside a transaction for ``seconds``. A process that
    stalls there (a GC pause, SIGSTOP, a lost network) otherwise keeps its row locks, and the partitions
    or runs they guard, from everyone else until it wakes up."""
    return {"idle_in_transaction_session_timeout": str(max(1, round(seconds * 1000)))}


# What a call can raise while the database restarts or the network drops; the roles' loops log it and
# try again. InternalClientError: a pooled connection the server dropped mid-operation (asyncpg#784).
DB_ERRORS = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError, TimeoutError)

# Errors of a server that is not accepting connections yet, or just now: starting, recovering from a
# crash, restarting (closing every session as it goes), or out of connection slots. A process starting
# meanwhile waits for it (up to CONNECT_WAIT_SEC) instead of exiting; a wrong password, database or URL
# still fails at once.
NOT_READY_ERRORS = (
    asyncpg.CannotConnectNowError,
    asyncpg.TooManyConnectionsError,
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    OSError,
    TimeoutError,
    asyncpg.TargetServerAttributeNotMatched,  # no host of the list is the primary: a failover under way
)

# Errors that say the database cannot be reached or cannot take writes now, as opposed to a refused
# statement: the API answers them with 503 and Retry-After.
UNAVAILABLE_ERRORS = (
    *NOT_READY_ERRORS,
    asyncpg.InterfaceError,  # ConnectionDoesNotExistError among them
    asyncpg.InternalClientError,
    asyncpg.PostgresConnectionError,
    asyncpg.ReadOnlySQLTransactionError,  # connected to a server that was demoted to a standby
    asyncpg.QueryCanceledError,
)

# Errors of the connection, the server's state or concurrency, never of the data sent: trying the
# same statement again later can succeed. asyncpg's client-side "invalid input for query argument"
# is an InterfaceError too, but also a ValueError: it is about one value, not transient
# (chimes.failures.is_transient).
TRANSIENT_ERRORS = (
    OSError,
    TimeoutError,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,
    asyncpg.InternalClientError,
    asyncpg.exceptions.OperatorInterventionError,  # admin shutdown, crash shutdown, cannot connect now
    asyncpg.exceptions.InsufficientResourcesError,  # too many connections, disk full
    asyncpg.exceptions.TransactionRollbackError,  # serialization failure, deadlock
    asyncpg.exceptions.LockNotAvailableError,
    asyncpg.exceptions.QueryCanceledError,  # statement_timeout
    asyncpg.exceptions.IdleInTransactionSessionTimeoutError,
    asyncpg.exceptions.ReadOnlySQLTransactionError,  # a primary demoted under us
)
CONNECT_WAIT_SEC = settings.DATABASE_WAIT_SEC


def set_connect_wait(seconds: float) -> None:
    """How long this process waits for a database that is not ready yet (``--database-wait``)."""
    global CONNECT_WAIT_SEC
    CONNECT_WAIT_SEC = seconds


class DatabaseUnavailable(ConnectionError):
    """The database did not accept a connection within the wait; the last error is the cause."""


async def when_ready(step: Callable[[], Awaitable[T]], wait_sec: float | None = None, *,
                     database: str | None = None) -> T:
    """Run ``step`` until the database lets it through, trying again from the start while the server is
    not ready, for up to ``wait_sec`` (default: ``--database-wait``). The step must be safe to repeat.
    ``database``: its URL, to name it (else the one the failure names)."""
    wait = CONNECT_WAIT_SEC if wait_sec is None else wait_sec
    deadline = time.monotonic() + wait
    pause = 0.1
    while True:
        try:
            return await step()
        except NOT_READY_ERRORS as exc:
            named = database_named(database) if database is not None else outage.database_of(exc)
            left = deadline - time.monotonic()
            if left <= 0:
                raise DatabaseUnavailable(
                    f"the database {named.label} is not accepting connections ({describe(exc)}); gave up after "
                    f"{wait:g} s (--database-wait)") from exc
            log.warning("database %s not ready (%s); trying again for up to %.0f s", named.label, describe(exc), left)
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, 2.0)


# What each database is to this process, by its URL and by the URL of each host of a multi-host one:
# "catalog" (the database the process was given), "shard N" (read from the map), a move's source or
# target. Outage messages name it (chimes.outage).
_ROLES: dict[str, str] = {}


def name_database(dsn: str, role: str) -> None:
    """Say what the database at ``dsn`` is to this process, for the messages that name it."""
    for url in {dsn, *split_hosts(dsn)}:
        _ROLES[url] = role


def database_named(url: str) -> outage.Database:
    """The database at ``url`` as messages name it: its role here, and its host and database name."""
    parts = urlsplit(url)
    where = f"{_server(url)}/{parts.path.lstrip('/') or '(default database)'}"
    role = _ROLES.get(url)
    return outage.Database(role, f"{role} ({where})" if role else where)


def describe(exc: BaseException) -> str:
    """An error as a log line names it: its type, then its message when it has one (a TimeoutError's
    is empty, which left lines such as ``_sync_leases failed: `` saying nothing)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass(frozen=True, slots=True)
class Timeouts:
    """How long a process waits on the database before it treats a connection, or a host, as gone.

    Without bounds, a connection to a host that vanished without a reset (a zone cut off, a machine
    powered off) is held until TCP gives up: minutes, up to about 15 on Linux defaults, and every
    role waiting on it stalls that long (issue 20).
    """

    connect_sec: float = settings.DATABASE_CONNECT_TIMEOUT_SEC  # per host of a multi-host URL
    command_sec: float | None = None  # per statement; None: no limit (migrations, imports, admin commands)
    keepalive_idle_sec: int = 5  # TCP keepalive: an idle connection is probed after this long...
    keepalive_interval_sec: int = 2  # ...then every this long...
    keepalive_count: int = 3  # ...and dropped when this many probes in a row go unanswered
    user_timeout_sec: float = 10.0  # data sent and not acknowledged this long: the connection is dropped
    # The same for connections without a statement timeout (migrations, imports, admin commands): some
    # kernels count a server that reads slowly (a zero window) against it, which must not end a COPY.
    unbounded_user_timeout_sec: float = 60.0


TIMEOUTS = Timeouts()
# The statement timeout of the long-running roles (API, scheduler, worker) unless --database-timeout
# says otherwise: well above their slowest statement (a fire or claim batch takes tens of ms, a
# dashboard page well under a second), well below what a stalled fleet costs.
ROLE_COMMAND_TIMEOUT_SEC = 10.0
_command_timeout_set: float | None = None  # --database-timeout, when given: overrides a role's default


def set_timeouts(connect_sec: float | None = None, command_sec: float | None = None) -> None:
    """``--database-connect-timeout`` and ``--database-timeout`` for this process."""
    global TIMEOUTS, _command_timeout_set
    if connect_sec is not None:
        TIMEOUTS = Timeouts(connect_sec=connect_sec)
    _command_timeout_set = command_sec


def command_timeout(role_default: float | None) -> float | None:
    """The statement timeout a role uses: ``--database-timeout`` when given (0: none), else its default."""
    if _command_timeout_set is None:
        return role_default
    return _command_timeout_set or None


def set_keepalive(conn: asyncpg.Connection, timeouts: Timeouts | None = None, *, bounded: bool = True) -> None:
    """TCP keepalives and a user timeout on the connection's socket, so a host that stops answering is
    noticed by the kernel within seconds whether the connection is idle (keepalive probes) or waiting
    for an answer (unacknowledged data). ``tcp_keepalives_*`` server settings only act on the server's
    side of the connection; these are the client's."""
    t = timeouts or TIMEOUTS
    transport = getattr(conn, "_transport", None)
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return  # a Unix socket: no network in between
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", t.keepalive_idle_sec), ("TCP_KEEPINTVL", t.keepalive_interval_sec),
                        ("TCP_KEEPCNT", t.keepalive_count),
                        ("TCP_USER_TIMEOUT",
                         round((t.user_timeout_sec if bounded else t.unbounded_user_timeout_sec) * 1000))):
        option = getattr(socket, name, None)
        if option is not None:  # Linux has them all; other systems some
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, option, value)


def split_hosts(dsn: str) -> list[str]:
    """A multi-host URL (``postgresql://u@h1:5432,h2:5432/db?...``) as one URL per host, in order; any
    other URL as itself."""
    parts = urlsplit(dsn)
    if parts.scheme not in ("postgres", "postgresql") or "," not in parts.netloc:
        return [dsn]
    userinfo, at, hosts = parts.netloc.rpartition("@")
    return [urlunsplit(parts._replace(netloc=f"{userinfo}{at}{host}")) for host in hosts.split(",") if host]


# Hosts that did not answer (connect timed out, or the network said no route), with when: tried last
# for a while, so that a pool replacing its connections does not wait on a vanished host first.
_UNANSWERED: dict[str, float] = {}
UNANSWERED_FOR_SEC = 30.0
NEXT_HOST_AFTER_SEC = 1.0  # a host that has not answered by then: the next one is tried meanwhile


def _by_answering(urls: list[str]) -> list[str]:
    now = time.monotonic()
    return sorted(urls, key=lambda url: now - _UNANSWERED.get(url, -1e9) < UNANSWERED_FOR_SEC)


async def _connect_host(url: str, kwargs: dict[str, Any]) -> asyncpg.Connection:
    named = database_named(url)
    kwargs.setdefault("connection_class", _NamedConnection)
    try:
        conn: asyncpg.Connection = await asyncpg.connect(url, **kwargs)
    except BaseException as exc:
        outage.blame(exc, named)
        if isinstance(exc, (TimeoutError, OSError)) and not isinstance(exc, ConnectionRefusedError):
            _UNANSWERED[url] = time.monotonic()  # refused: the host is there, its server is not
        raise
    _UNANSWERED.pop(url, None)
    if isinstance(conn, _NamedConnection):
        conn.database = named
    try:
        set_keepalive(conn, bounded=kwargs.get("command_timeout") is not None)
    except BaseException:
        conn.terminate()
        raise
    outage.connected(named)
    return conn


def _server(url: str) -> str:
    """host:port of a one-host URL, for the log (no user, no password)."""
    parts = urlsplit(url)
    return parts.netloc.rpartition("@")[2] or "the local socket"


async def open_connection(dsn: str, **kwargs: Any) -> asyncpg.Connection:
    """A connection with a bounded connect and TCP keepalives.

    The hosts of a multi-host URL are tried each for up to the connect timeout, in order, but the next
    one is started when a host has not answered within a second, and hosts that did not answer lately
    go last: asyncpg's own ``timeout`` covers the whole list, so one vanished host used it all up and
    the others were never tried. ``target_session_attrs`` is checked on each host; the first host that
    matches wins and the attempts still under way are dropped."""
    kwargs.setdefault("timeout", TIMEOUTS.connect_sec)
    urls = split_hosts(dsn)
    if len(urls) == 1:
        return await _connect_host(urls[0], kwargs)
    waiting = _by_answering(urls)
    pending: set[asyncio.Task[asyncpg.Connection]] = set()
    errors: list[BaseException] = []
    try:
        while waiting or pending:
            if waiting:
                pending.add(asyncio.ensure_future(_connect_host(waiting.pop(0), kwargs)))
            done, pending = await asyncio.wait(pending, timeout=NEXT_HOST_AFTER_SEC if waiting else None,
                                               return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.exception() is None:
                    return task.result()
                errors.append(task.exception())  # type: ignore[arg-type]
        raise _most_telling(errors)
    finally:
        for task in pending:
            task.cancel()
            task.add_done_callback(_drop_connection)


def any_server(dsn: str) -> str:
    """``dsn`` without its ``target_session_attrs``: a connection to whichever host answers first,
    primary or standby (for reads while no primary is reachable)."""
    parts = urlsplit(dsn)
    query = "&".join(item for item in parts.query.split("&") if item and not item.startswith("target_session_attrs="))
    return urlunsplit(parts._replace(query=query))


async def server_role(url: str, within: float) -> str:
    """What the server of a one-host URL is now: ``primary``, ``standby``, ``refusing connections``
    or ``not answering`` (for /healthz; any ``target_session_attrs`` of the URL is ignored)."""
    try:
        conn = await asyncpg.connect(any_server(url), timeout=within)
    except (TimeoutError, OSError) as exc:
        return "refusing connections" if isinstance(exc, ConnectionRefusedError) else "not answering"
    except Exception:  # the server answered, and said no: starting up, shutting down, too many clients
        return "refusing connections"
    try:
        standby = await asyncio.wait_for(conn.fetchval(sql("in_recovery")), within)
        return "standby" if standby else "primary"
    except Exception:
        return "not answering"
    finally:
        conn.terminate()


def _drop_connection(task: asyncio.Task[asyncpg.Connection]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().terminate()  # connected just as another host won


def _most_telling(errors: list[BaseException]) -> BaseException:
    """The error to raise when no host would do: a server's own answer (a standby, starting up, a
    wrong password) says more than a host that did not answer."""
    for error in errors:
        if not isinstance(error, (TimeoutError, OSError)):
            return error
    return errors[-1]


class _NamedConnection(asyncpg.Connection):
    """A connection that knows which database it is to (set on connect), and records it on the errors
    of the server or the connection its statements meet (chimes.outage.blame): a failure mid-statement
    is the first of an outage, and its message names the database."""

    database: outage.Database = outage.UNKNOWN


def _naming_failures(name: str) -> Callable[..., Awaitable[Any]]:
    method = getattr(asyncpg.Connection, name)

    @functools.wraps(method)
    async def call(self: _NamedConnection, *args: Any, **kwargs: Any) -> Any:
        try:
            return await method(self, *args, **kwargs)
        except UNAVAILABLE_ERRORS as exc:
            outage.blame(exc, self.database)
            raise

    return call


# Every statement a connection (or a pool, through its proxies) runs goes through one of these;
# transactions run theirs with execute.
for _name in ("execute", "executemany", "fetch", "fetchval", "fetchrow", "fetchmany", "copy_from_table",
              "copy_from_query", "copy_to_table", "copy_records_to_table", "prepare"):
    setattr(_NamedConnection, _name, _naming_failures(_name))


class _PooledConnection(_NamedConnection):
    """A pooled connection given back as it is, without asyncpg's reset query (``RESET ALL``, ``UNLISTEN
    *``, ``CLOSE ALL``, ``pg_advisory_unlock_all()``): a round trip at every release, a write and a
    wake-up of the server for every batch and every API read. Chimes leaves nothing on a pooled
    connection for it to undo: settings are ``SET LOCAL``, LISTEN and session-level advisory locks
    are only taken on connections of their own (chimes.store.working.RunSignals, migrations, the shard
    probe). A transaction left open is still rolled back when the connection is given back."""

    def get_reset_query(self) -> str:
        return ""


async def _pool_connect(dsn: str | None = None, **kwargs: Any) -> asyncpg.Connection:
    if dsn is None:  # asyncpg's connect callback may be called without one; create_pool below passes it
        raise TypeError("the pool's connect callback needs a DSN")
    kwargs.pop("loop", None)
    return await open_connection(dsn, **kwargs)


async def create_pool(dsn: str, *, min_size: int = 1, max_size: int = 10, wait_sec: float | None = None,
                      command_timeout: float | None = None, **kwargs: Any) -> asyncpg.Pool:
    """A pool of connections set up for Chimes; waits for a database that is not ready yet.

    Every connection has TCP keepalives and a bounded connect (see :func:`open_connection`); every
    statement is bounded by ``command_timeout`` (a role's default, or ``--database-timeout``). A
    statement that times out is cancelled, and when the cancel cannot reach the server either, asyncpg
    closes the connection: the next acquire opens a new one, through the host list. A connection given
    back inside a transaction is rolled back, bounded the same way, and closed if that fails; others
    are given back as they are (:class:`_PooledConnection`)."""
    settings = {**SESSION_SETTINGS, **(kwargs.pop("server_settings", None) or {})}

    async def open_pool() -> asyncpg.Pool:
        pool = await asyncpg.create_pool(
            dsn, min_size=min_size, max_size=max_size, init=_init_connection, server_settings=settings,
            connect=_pool_connect, command_timeout=command_timeout, connection_class=_PooledConnection, **kwargs
        )
        assert pool is not None
        return pool

    return await when_ready(open_pool, wait_sec, database=dsn)


async def _open_connection(dsn: str, command_timeout: float | None = None) -> asyncpg.Connection:
    conn = await open_connection(dsn, server_settings=SESSION_SETTINGS, command_timeout=command_timeout)
    try:
        await _init_connection(conn)
    except BaseException:
        conn.terminate()
        raise
    return conn


async def connect(dsn: str, *, wait_sec: float | None = None) -> asyncpg.Connection:
    return await when_ready(lambda: _open_connection(dsn), wait_sec, database=dsn)


async def with_connection(dsn: str, step: Callable[[asyncpg.Connection], Awaitable[T]], *,
                          wait_sec: float | None = None) -> T:
    """Run ``step`` on a connection of its own, closed after. A server that goes away in the middle
    (restarting, crashing) means a fresh connection and the step from the start, within the wait: what
    a process does on start-up must not make it exit when the database restarts at that moment (found
    by ``chimes chaos``). The step must be safe to repeat: one transaction, or work that checks first."""
    async def once() -> T:
        conn = await _open_connection(dsn)
        try:
            return await step(conn)
        finally:
            if not conn.is_closed():
                await conn.close(timeout=TIMEOUTS.connect_sec)

    return await when_ready(once, wait_sec, database=dsn)


@contextlib.contextmanager
def database_url(settings: Settings, archiving: Archiving | None = None) -> Any:
    """Yield the DSN to use: the configured URL, or the embedded server (started and shared as needed),
    with WAL archiving turned on or off as ``archiving`` says (None: as it is)."""
    if settings.database_url is not None:
        name_database(settings.database_url, "catalog")
        yield settings.database_url
        return
    server = EmbeddedPostgres(settings.data_dir)
    dsn = server.acquire(archiving)
    name_database(dsn, "catalog")
    try:
        yield dsn
    finally:
        server.release()


async def ping(pool: asyncpg.Pool) -> None:
    """One round trip to the database: raises whatever reaching it raises."""
    await pool.fetchval(sql("ping"))


@contextlib.asynccontextmanager
async def transaction(pool: asyncpg.Pool) -> AsyncIterator[Conn]:
    async with pool.acquire() as conn, conn.transaction():
        yield conn
