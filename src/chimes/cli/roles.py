"""The long-running roles, each a coroutine that runs until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine
from typing import Any

import click
from fastapi import FastAPI

from chimes.api.app import create_app
from chimes.cli.runtime import api_server, on_shutdown_signals, prepare_role_database
from chimes.cli.security_options import ApiSecurity, WorkerSecurity
from chimes.scheduler.leases import LeaseConfig
from chimes.scheduler.node import SchedulerConfig, SchedulerNode
from chimes.security.secrets import Keyring, SecretKeyError
from chimes.services.owners import SigningSecrets, check_secret_key
from chimes.settings import CONTAINER_RUNTIME, MISSED_AFTER_SEC, NOTIFY_GIVE_UP_HOURS, RETENTION_DAYS, Settings
from chimes.store import db, tokens
from chimes.store.cap_slots import CapSlots
from chimes.store.shards import ShardMap
from chimes.worker.budget import SlotBudget
from chimes.worker.guard import TaskGuard
from chimes.worker.tasks.container import remove_orphaned_env_files
from chimes.worker.tasks.dispatch import Executors
from chimes.worker.worker import Worker, WorkerConfig

log = logging.getLogger("chimes")


async def run_all_in_one(dsn: str, settings: Settings, worker_concurrency: int,
                         api: ApiSecurity | None = None, work: WorkerSecurity | None = None) -> None:
    shard_map = await prepare_role_database(dsn)
    await _announce_admin_token(dsn, allow_commands=bool(work and work.allow_commands))
    pool = await db.create_pool(dsn, max_size=12, command_timeout=db.command_timeout(db.ROLE_COMMAND_TIMEOUT_SEC))
    homes = [(pool, dsn)]
    try:
        if work is not None:  # before anything starts: a wrong key must not leave half the roles running
            await _require_database_key(pool, work.keyring)
        homes += await _shard_pools(shard_map, max_size=12)
    except BaseException:
        await _close_pools(homes)
        raise
    _remove_orphaned_env_files()
    server = api_server(_app(dsn, api), settings.host, settings.port, api.trusted_proxies if api else ())
    nodes = [SchedulerNode(home, signing_secrets=SigningSecrets(pool, work.keyring if work else None),
                           egress=work.egress if work else None) for home, _ in homes]
    # As for `chimes worker --container-runtime`.
    runtime = os.environ.get("CHIMES_CONTAINER_RUNTIME", CONTAINER_RUNTIME)
    allow_commands = bool(work and work.allow_commands)
    guard = TaskGuard(pool, work.keyring if work else None, allow_commands=allow_commands)
    budget = _budget(worker_concurrency, homes)
    cap_slots = _cap_slots(shard_map, pool)
    workers = [Worker(home, url, WorkerConfig(concurrency=worker_concurrency, allow_commands=allow_commands),
                      executors=Executors(container_runtime=runtime, egress=work.egress if work else None),
                      guard=guard, budget=budget, cap_slots=cap_slots, shard_id=_shard_id(shard_map, url, i))
               for i, (home, url) in enumerate(homes)]

    def stop() -> None:
        server.stop()
        for node in nodes:
            node.stop()
        for worker in workers:
            worker.stop()

    on_shutdown_signals(stop)
    click.echo(f"Chimes is up: API on http://{settings.host}:{settings.port} (Ctrl-C to stop)", err=True)
    try:
        results = await asyncio.gather(server.serve(), *(node.run() for node in nodes),
                                       *(worker.run() for worker in workers), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
    finally:
        await _close_pools(homes)


async def _require_database_key(pool: db.Pool, keyring: Keyring) -> None:
    """Stop at start-up, pool closed, when this process's secret key is not the database's."""
    try:
        await db.when_ready(lambda: check_secret_key(pool, keyring))
    except SecretKeyError as exc:
        await pool.close()
        raise click.ClickException(str(exc)) from None


def _app(dsn: str, api: ApiSecurity | None) -> FastAPI:
    return create_app(dsn, limits=api.limits, keyring=api.keyring) if api else create_app(dsn)


async def run_api(dsn: str, settings: Settings, api: ApiSecurity | None = None) -> None:
    await prepare_role_database(dsn)
    server = api_server(_app(dsn, api), settings.host, settings.port, api.trusted_proxies if api else ())
    on_shutdown_signals(server.stop)
    log.info("API listening on http://%s:%d", settings.host, settings.port)
    await server.serve()


async def run_scheduler(dsn: str, node_id: str | None, lease_ttl: float, retention_days: int = RETENTION_DAYS,
                        missed_after: float = MISSED_AFTER_SEC, outgoing: WorkerSecurity | None = None, *,
                        notify_give_up_sec: float = NOTIFY_GIVE_UP_HOURS * 3600) -> None:
    shard_map = await prepare_role_database(dsn)
    # A node stalled inside a fire holds its lease rows: no takeover until the session ends.
    settings = db.lock_holding_limit(lease_ttl)
    pool = await db.create_pool(dsn, max_size=6, server_settings=settings,
                                command_timeout=db.command_timeout(db.ROLE_COMMAND_TIMEOUT_SEC))
    homes = [(pool, dsn)]
    try:
        if outgoing is not None:  # it signs webhooks: a wrong key is a start-up error, as for a worker
            await _require_database_key(pool, outgoing.keyring)
        homes += await _shard_pools(shard_map, max_size=6, server_settings=settings)
    except BaseException:
        await _close_pools(homes)
        raise
    lease = LeaseConfig(ttl_sec=lease_ttl, renew_every_sec=min(1.0, lease_ttl / 4))
    config = SchedulerConfig(lease=lease, retention_days=retention_days, missed_after_sec=missed_after,
                             notify_give_up_sec=notify_give_up_sec)
    # One node per home (the catalog, then each shard): its leases, scans, fires and reaper on that
    # home's database; owners' signing secrets from the catalog.
    nodes = [SchedulerNode(home, config, node_id=node_id,
                           signing_secrets=SigningSecrets(pool, outgoing.keyring if outgoing else None),
                           egress=outgoing.egress if outgoing else None) for home, _ in homes]

    def stop() -> None:
        for node in nodes:
            node.stop()

    on_shutdown_signals(stop)
    try:
        await _run_together([node.run() for node in nodes], stop)
    finally:
        await _close_pools(homes)


async def run_worker(dsn: str, concurrency: int, worker_id: str | None, lease_sec: float,
                     shutdown_grace: float, executors: Callable[[], Executors] | None = None,
                     work: WorkerSecurity | None = None) -> None:
    """``executors`` makes the executors of one home's worker (each closes its own when it stops)."""
    shard_map = await prepare_role_database(dsn)
    # A worker stalled inside a claim holds the claimed runs: nobody else starts them meanwhile.
    settings = db.lock_holding_limit(lease_sec)
    pool = await db.create_pool(dsn, max_size=4, server_settings=settings,
                                command_timeout=db.command_timeout(db.ROLE_COMMAND_TIMEOUT_SEC))
    try:
        homes = [(pool, dsn), *await _shard_pools(shard_map, max_size=4, server_settings=settings)]
    except BaseException:
        await pool.close()
        raise
    allow_commands = bool(work and work.allow_commands)
    config = WorkerConfig(concurrency=concurrency, lease_sec=lease_sec,
                          heartbeat_every_sec=lease_sec / 3, shutdown_grace_sec=shutdown_grace,
                          allow_commands=allow_commands)
    # Owners, secrets and the secret key are the catalog's, whichever home a run comes from.
    guard = TaskGuard(pool, work.keyring if work else None, allow_commands=allow_commands)
    budget = _budget(concurrency, homes)
    cap_slots = _cap_slots(shard_map, pool)
    workers = [Worker(home, url, config, worker_id=worker_id, executors=executors() if executors else None,
                      guard=guard, budget=budget, cap_slots=cap_slots, shard_id=_shard_id(shard_map, url, i))
               for i, (home, url) in enumerate(homes)]
    _remove_orphaned_env_files()

    def stop() -> None:
        for worker in workers:
            worker.stop()

    on_shutdown_signals(stop)
    try:
        await _run_together([worker.run() for worker in workers], stop)
    finally:
        await _close_pools(homes)


async def _run_together(runs: list[Coroutine[Any, Any, None]], stop: Callable[[], None]) -> None:
    """Run one home's node or worker per coroutine until all end; when one fails, stop the others, let
    them finish, and raise its error (one home's failure ends the process, as with one database)."""
    tasks = [asyncio.ensure_future(run) for run in runs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        stop()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error


def _budget(concurrency: int, homes: list[tuple[db.Pool, str]]) -> SlotBudget | None:
    """With shards, the process's claim loops (one per home) share ``concurrency`` slots: each waits
    on its own queue, so an idle shard slows no other, and its slots go to the busy ones."""
    return SlotBudget(concurrency) if len(homes) > 1 else None


def _cap_slots(shard_map: ShardMap, catalog: db.Pool) -> CapSlots | None:
    """With shards, capped runs take slots in the catalog before they are claimed, wherever they live
    (docs/scaling.md, "Caps and quotas across shards"); with one database, caps are counted from
    its running runs, as before."""
    return CapSlots(catalog) if shard_map.ranges else None


def _shard_id(shard_map: ShardMap, url: str, index: int) -> int | None:
    """The shard a home is (None: the catalog, the first home)."""
    if index == 0:
        return None
    return next(r.shard_id for r in shard_map.ranges if r.url == url)


async def _shard_pools(shard_map: ShardMap, *, max_size: int,
                       server_settings: dict[str, str] | None = None) -> list[tuple[db.Pool, str]]:
    """A pool per shard of the map, with the URL it was opened on; none for the empty map."""
    homes: list[tuple[db.Pool, str]] = []
    try:
        for url in shard_map.urls():
            homes.append((await db.create_pool(url, max_size=max_size, server_settings=server_settings,
                                               command_timeout=db.command_timeout(db.ROLE_COMMAND_TIMEOUT_SEC)),
                          url))
    except BaseException:
        await _close_pools(homes)
        raise
    return homes


async def _close_pools(homes: list[tuple[db.Pool, str]]) -> None:
    for pool, _ in homes:
        await pool.close()


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
