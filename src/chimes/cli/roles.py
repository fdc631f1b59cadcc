"""The long-running roles, each a coroutine that runs until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
from collections.abc import Callable

import click
from fastapi import FastAPI

from chimes.api import presence
from chimes.api.app import create_app
from chimes.cli.role_processes import RoleCommand, RoleProcesses, describe_exit
from chimes.cli.runtime import (
    ApiBindError,
    ApiServer,
    api_server,
    migrate_shards,
    on_shutdown_signals,
    prepare_role_database,
)
from chimes.cli.security_options import ApiSecurity, WorkerSecurity
from chimes.cli.served_homes import Role, ServedHomes, StartHome
from chimes.scheduler.calendar_book import CalendarBook
from chimes.scheduler.leases import LeaseConfig
from chimes.scheduler.node import SchedulerConfig, SchedulerNode, new_node_id
from chimes.security.secrets import Keyring, SecretKeyError, default_keyring
from chimes.services.owners import SigningSecrets, check_secret_key
from chimes.settings import (
    CONTAINER_RUNTIME,
    FIRE_AHEAD_SEC,
    MISSED_AFTER_SEC,
    NOTIFY_GIVE_UP_HOURS,
    RETENTION_DAYS,
    Settings,
)
from chimes.store import db, tokens
from chimes.store.cap_slots import CapSlots
from chimes.store.shards import ShardMap
from chimes.worker.budget import SlotBudget
from chimes.worker.guard import TaskGuard
from chimes.worker.tasks.container import remove_orphaned_env_files
from chimes.worker.tasks.dispatch import Executors
from chimes.worker.tiers import OWNER_SHARE, TierPolicy
from chimes.worker.worker import Worker, WorkerConfig, new_worker_id

log = logging.getLogger("chimes")
# Connections per database. A scheduler node fires up to fire_concurrency batches at once and holds
# fire_ahead_concurrency more open until their instant (SchedulerConfig): 7 of these while a burst
# is fired ahead, with its scans, leases and reaper beside them; one process of every role also
# claims, records outcomes and serves the API.
SCHEDULER_POOL = 10
ALL_IN_ONE_POOL = 16
WORKER_POOL = 4  # heartbeats, outcomes, cap slots: a worker's claims have a connection of their own


async def run_all_in_one(dsn: str, settings: Settings, worker_concurrency: int,
                         api: ApiSecurity | None = None, work: WorkerSecurity | None = None) -> None:
    shard_map = await prepare_role_database(dsn)
    await _announce_admin_token(dsn, allow_commands=bool(work and work.allow_commands))
    pool = await db.create_pool(dsn, max_size=ALL_IN_ONE_POOL,
                                command_timeout=db.command_timeout(db.ROLE_COMMAND_TIMEOUT_SEC))
    try:
        if work is not None:  # before anything starts: a wrong key must not leave half the roles running
            await _require_database_key(pool, work.keyring)
    except BaseException:
        await pool.close()
        raise
    _remove_orphaned_env_files()
    server = api_server(_app(dsn, api), settings.host, settings.port, api.trusted_proxies if api else (),
                        announce=lambda: click.echo(f"Chimes is up: API on http://{settings.host}:{settings.port} "
                                                    "(Ctrl-C to stop)", err=True))
    try:
        _bind(server)
    except BaseException:
        await pool.close()
        raise
    node_id, worker_id = new_node_id(), new_worker_id()  # one id each on every home
    # As for `chimes worker --container-runtime`.
    runtime = os.environ.get("CHIMES_CONTAINER_RUNTIME", CONTAINER_RUNTIME)
    allow_commands = bool(work and work.allow_commands)
    guard = TaskGuard(pool, work.keyring if work else None, allow_commands=allow_commands)
    budget = SlotBudget(worker_concurrency)  # shared by every home's claim loop, as in `chimes worker`

    cap_slots = CapSlots(pool)
    _settle_the_heap()

    tiers = TierPolicy(owner_share=work.owner_share if work else OWNER_SHARE)

    def start_home(home: db.Pool, url: str, serves: frozenset[int] | None, shard_id: int | None) -> list[Role]:
        node = SchedulerNode(home, node_id=node_id, serves=serves, egress=work.egress if work else None,
                             signing_secrets=SigningSecrets(pool, work.keyring if work else None),
                             calendars=CalendarBook(pool), listen_dsn=url)
        config = WorkerConfig(concurrency=worker_concurrency, allow_commands=allow_commands, tiers=tiers)
        worker = Worker(home, url, config,
                        worker_id=worker_id,
                        executors=Executors(container_runtime=runtime, egress=work.egress if work else None),
                        guard=guard, budget=budget, cap_slots=_with_shards(cap_slots, serves), shard_id=shard_id)
        return [node, worker]

    homes = ServedHomes(pool, dsn, shard_map, start_home, pool_size=ALL_IN_ONE_POOL,
                        serves_changed=lambda roles, serves: _serves_changed(roles, serves, cap_slots))
    try:
        await homes.open()
    except BaseException:
        await pool.close()
        raise

    def stop() -> None:
        server.stop()
        homes.stop()

    on_shutdown_signals(stop)
    try:
        results = await asyncio.gather(server.serve(), homes.run(), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
    finally:
        await homes.close()
        await pool.close()


async def run_up(dsn: str, settings: Settings, children: list[RoleCommand], stop_wait_sec: float,
                 api: ApiSecurity | None = None, work: WorkerSecurity | None = None) -> None:
    """``chimes up``: the API here, the scheduler and the worker as supervised child processes
    (chimes.cli.role_processes); until SIGTERM or SIGINT, or until a child exits on its own."""
    await prepare_role_database(dsn)
    await _announce_admin_token(dsn, allow_commands=bool(work and work.allow_commands))
    if work is not None:  # before any child starts: a wrong key must not leave half the roles running
        pool = await db.create_pool(dsn, min_size=1, max_size=1,
                                    command_timeout=db.command_timeout(db.ROLE_COMMAND_TIMEOUT_SEC))
        try:
            await _require_database_key(pool, work.keyring)
        finally:
            await pool.close()
    roles = RoleProcesses(children, stop_wait_sec)
    server = api_server(_app(dsn, api), settings.host, settings.port, api.trusted_proxies if api else (),
                        announce=lambda: click.echo(
                            f"Chimes is up: API on http://{settings.host}:{settings.port}, scheduler and worker in "
                            f"processes {', '.join(str(p.pid) for p in roles.procs.values())} (Ctrl-C to stop)",
                            err=True))
    _bind(server)  # before any child starts: a port in use must not leave the roles running
    await roles.start()

    def stop() -> None:
        server.stop()
        roles.stop()

    on_shutdown_signals(stop)
    serving = asyncio.create_task(server.serve())
    child_exit = asyncio.create_task(roles.first_exit())
    failed: str | None = None
    try:
        await asyncio.wait({serving, child_exit}, return_when=asyncio.FIRST_COMPLETED)
        if child_exit.done() and not roles.stopping:
            role, pid, status = child_exit.result()
            failed = f"the {role} process (pid {pid}) {describe_exit(status)}: chimes up stops"
            log.error("%s", failed)
        stop()
        await serving
    finally:
        child_exit.cancel()
        roles.stop()
        await roles.wait()
    if failed:
        raise click.ClickException(failed)


async def _require_database_key(pool: db.Pool, keyring: Keyring) -> None:
    """Stop at start-up, pool closed, when this process's secret key is not the database's."""
    try:
        await db.when_ready(lambda: check_secret_key(pool, keyring))
    except SecretKeyError as exc:
        await pool.close()
        raise click.ClickException(str(exc)) from None


def _bind(server: ApiServer) -> None:
    try:
        server.bind()
    except ApiBindError as exc:
        raise click.ClickException(str(exc)) from None


def _app(dsn: str, api: ApiSecurity | None) -> FastAPI:
    return create_app(dsn, limits=api.limits, keyring=api.keyring) if api else create_app(dsn)


async def run_api(dsn: str, settings: Settings, api: ApiSecurity | None = None) -> None:
    await migrate_shards(await prepare_role_database(dsn))
    server = api_server(_app(dsn, api), settings.host, settings.port, api.trusted_proxies if api else ())
    on_shutdown_signals(server.stop)
    # Its own connection: the heartbeat that says which release this server runs waits on no request.
    pool = await db.create_pool(dsn, min_size=1, max_size=1,
                                command_timeout=db.command_timeout(db.ROLE_COMMAND_TIMEOUT_SEC))
    try:
        # Here, as one line: in the app's start-up, uvicorn would log the error's whole traceback.
        await _require_database_key(pool, api.keyring if api else default_keyring())
        _bind(server)
    except BaseException:
        await pool.close()
        raise
    server_id = presence.new_server_id()
    beat = asyncio.create_task(presence.heartbeat(pool, server_id))
    try:
        await server.serve()
    finally:
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat
        await presence.leave(pool, server_id)
        await pool.close()


async def run_scheduler(dsn: str, node_id: str | None, lease_ttl: float, retention_days: int = RETENTION_DAYS,
                        missed_after: float = MISSED_AFTER_SEC, outgoing: WorkerSecurity | None = None, *,
                        notify_give_up_sec: float = NOTIFY_GIVE_UP_HOURS * 3600,
                        fire_ahead_sec: float = FIRE_AHEAD_SEC) -> None:
    shard_map = await prepare_role_database(dsn)
    # A node stalled inside a fire holds its lease rows: no takeover until the session ends.
    settings = db.lock_holding_limit(lease_ttl)
    pool = await db.create_pool(dsn, max_size=SCHEDULER_POOL, server_settings=settings,
                                command_timeout=db.command_timeout(db.ROLE_COMMAND_TIMEOUT_SEC))
    try:
        if outgoing is not None:  # it signs webhooks: a wrong key is a start-up error, as for a worker
            await _require_database_key(pool, outgoing.keyring)
    except BaseException:
        await pool.close()
        raise
    lease = LeaseConfig(ttl_sec=lease_ttl, renew_every_sec=min(1.0, lease_ttl / 4))
    # A batch fired ahead is idle inside its transaction until its instant: well inside the session's
    # limit (lock_holding_limit), which ends it after the lease's time.
    config = SchedulerConfig(lease=lease, retention_days=retention_days, missed_after_sec=missed_after,
                             notify_give_up_sec=notify_give_up_sec, fire_ahead_sec=min(fire_ahead_sec, lease_ttl / 2))
    # One id for the process on every home, so the fleet page sees one node serving every shard.
    node_id = node_id or new_node_id()

    # One node per home (the catalog, then each shard): its leases, scans, fires and reaper on that
    # home's database; owners' signing secrets from the catalog.
    def start_home(home: db.Pool, url: str, serves: frozenset[int] | None, shard_id: int | None) -> list[Role]:
        return [SchedulerNode(home, config, node_id=node_id,
                              signing_secrets=SigningSecrets(pool, outgoing.keyring if outgoing else None),
                              egress=outgoing.egress if outgoing else None, serves=serves,
                              calendars=CalendarBook(pool), listen_dsn=url)]

    _settle_the_heap()
    await _serve_homes(pool, dsn, shard_map, start_home, pool_size=SCHEDULER_POOL, server_settings=settings)


async def run_worker(dsn: str, concurrency: int, worker_id: str | None, lease_sec: float,
                     shutdown_grace: float, executors: Callable[[], Executors] | None = None,
                     work: WorkerSecurity | None = None) -> None:
    """``executors`` makes the executors of one home's worker (each closes its own when it stops)."""
    shard_map = await prepare_role_database(dsn)
    # A worker stalled inside a claim holds the claimed runs: nobody else starts them meanwhile.
    settings = db.lock_holding_limit(lease_sec)
    pool = await db.create_pool(dsn, max_size=WORKER_POOL, server_settings=settings,
                                command_timeout=db.command_timeout(db.ROLE_COMMAND_TIMEOUT_SEC))
    allow_commands = bool(work and work.allow_commands)
    config = WorkerConfig(concurrency=concurrency, lease_sec=lease_sec,
                          heartbeat_every_sec=lease_sec / 3, shutdown_grace_sec=shutdown_grace,
                          allow_commands=allow_commands,
                          tiers=TierPolicy(owner_share=work.owner_share if work else OWNER_SHARE))
    # Owners, secrets and the secret key are the catalog's, whichever home a run comes from.
    guard = TaskGuard(pool, work.keyring if work else None, allow_commands=allow_commands)
    # The process's claim loops (one per home) share its slots: each waits on its own queue, so an
    # idle shard slows no other, and its slots go to the busy ones.
    budget = SlotBudget(concurrency)
    worker_id = worker_id or new_worker_id()  # one id on every home, as the node's
    _remove_orphaned_env_files()

    cap_slots = CapSlots(pool)
    _settle_the_heap()

    def start_home(home: db.Pool, url: str, serves: frozenset[int] | None, shard_id: int | None) -> list[Role]:
        return [Worker(home, url, config, worker_id=worker_id, executors=executors() if executors else None,
                       guard=guard, budget=budget, cap_slots=_with_shards(cap_slots, serves), shard_id=shard_id)]

    await _serve_homes(pool, dsn, shard_map, start_home, pool_size=WORKER_POOL, server_settings=settings,
                       cap_slots=cap_slots)


async def _serve_homes(pool: db.Pool, dsn: str, shard_map: ShardMap, start_home: StartHome, *, pool_size: int,
                       server_settings: dict[str, str], cap_slots: CapSlots | None = None) -> None:
    """Run the roles of every home of the map, following it, until SIGTERM or SIGINT; close the pools."""
    homes = ServedHomes(pool, dsn, shard_map, start_home, pool_size=pool_size, server_settings=server_settings,
                        serves_changed=lambda roles, serves: _serves_changed(roles, serves, cap_slots))
    try:
        await homes.open()
        on_shutdown_signals(homes.stop)
        await homes.run()
    finally:
        await homes.close()
        await pool.close()


#: Allocations (less deallocations) of container objects between two collections of the youngest
#: generation; Python's default is 700. A run's objects (its task, coroutines, futures, headers,
#: outcome) die with it, freed by their reference counts, and make no cycles, so collecting them
#: finds no garbage. At 700 a burst triggers hundreds of collections that carry every run in flight
#: into the older generations and through them, at a cost in CPU and for nothing; a higher threshold
#: makes them few and short. What is garbage waits for at most that many allocations.
GC_YOUNG_THRESHOLD = 10_000


def _settle_the_heap() -> None:
    """Called once a process that fires or runs runs is set up. What it made to start (modules, their
    tables and schemas: most of its objects) lives as long as it does: frozen out of the garbage
    collector's sight, a full collection goes through what was made since only. The youngest
    generation is collected less often (GC_YOUNG_THRESHOLD); the older ones keep their ratios."""
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, oldest)


def _with_shards(cap_slots: CapSlots, serves: frozenset[int] | None) -> CapSlots | None:
    """With shards (a home serves some partitions only), capped runs take slots in the catalog
    (docs/scaling.md, "Caps and quotas across shards"); with one database, caps are counted from its
    running runs, as before."""
    return None if serves is None else cap_slots


def _serves_changed(roles: list[Role], serves: frozenset[int] | None, cap_slots: CapSlots | None) -> None:
    """The map changed while a home's roles ran: the node's partitions gauge, and whether the worker
    counts caps in the catalog."""
    for role in roles:
        if isinstance(role, SchedulerNode):
            role.leases.serves = serves
        elif isinstance(role, Worker) and cap_slots is not None:
            role.count_caps_in(_with_shards(cap_slots, serves))


def _remove_orphaned_env_files() -> None:
    if removed := remove_orphaned_env_files():
        log.warning("removed %d container env folders left by workers that died mid-run", removed)


async def _announce_admin_token(dsn: str, allow_commands: bool = False) -> None:
    """On the first start, create an admin token and print it: the only time it is ever shown.
    With ``allow_commands`` (chimes up's default), its owner may also run command tasks."""
    token = await db.with_connection(dsn, lambda conn: tokens.create_first_admin_token(
        conn, "created by chimes up", allow_commands=allow_commands))
    if token is None:
        return
    click.echo(
        "\nThis is the admin token; it is shown only now, so keep it:\n\n"
        f"    {token}\n\n"
        "More tokens: chimes token create --owner TEAM [--admin]\n"
    )
