"""The long-running roles, each a coroutine that runs until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import logging

import click

from chimes.api.app import create_app
from chimes.cli.runtime import api_server, migrate_database, on_shutdown_signals
from chimes.scheduler.leases import LeaseConfig
from chimes.scheduler.node import SchedulerConfig, SchedulerNode
from chimes.settings import Settings
from chimes.store import db, tokens
from chimes.store.queries import sql
from chimes.worker.worker import Worker, WorkerConfig

log = logging.getLogger("chimes")


async def run_all_in_one(dsn: str, settings: Settings, worker_concurrency: int) -> None:
    await migrate_database(dsn)
    await _announce_admin_token(dsn)
    pool = await db.create_pool(dsn, max_size=12)
    server = api_server(create_app(dsn), settings.host, settings.port)
    node = SchedulerNode(pool)
    worker = Worker(pool, dsn, WorkerConfig(concurrency=worker_concurrency))

    def stop() -> None:
        server.stop()
        node.stop()
        worker.stop()

    on_shutdown_signals(stop)
    click.echo(f"Chimes is up: API on http://{settings.host}:{settings.port} (Ctrl-C to stop)", err=True)
    try:
        results = await asyncio.gather(server.serve(), node.run(), worker.run(), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
    finally:
        await pool.close()


async def run_api(dsn: str, settings: Settings) -> None:
    await migrate_database(dsn)
    server = api_server(create_app(dsn), settings.host, settings.port)
    on_shutdown_signals(server.stop)
    log.info("API listening on http://%s:%d", settings.host, settings.port)
    await server.serve()


async def run_scheduler(dsn: str, node_id: str | None, lease_ttl: float) -> None:
    await migrate_database(dsn)
    pool = await db.create_pool(dsn, max_size=6)
    lease = LeaseConfig(ttl_sec=lease_ttl, renew_every_sec=min(1.0, lease_ttl / 4))
    node = SchedulerNode(pool, SchedulerConfig(lease=lease), node_id=node_id)
    on_shutdown_signals(node.stop)
    try:
        await node.run()
    finally:
        await pool.close()


async def run_worker(dsn: str, concurrency: int, worker_id: str | None, lease_sec: float,
                     shutdown_grace: float) -> None:
    await migrate_database(dsn)
    pool = await db.create_pool(dsn, max_size=4)
    config = WorkerConfig(concurrency=concurrency, lease_sec=lease_sec, heartbeat_every_sec=lease_sec / 3,
                          shutdown_grace_sec=shutdown_grace)
    worker = Worker(pool, dsn, config, worker_id=worker_id)
    on_shutdown_signals(worker.stop)
    try:
        await worker.run()
    finally:
        await pool.close()


async def _announce_admin_token(dsn: str) -> None:
    """On the first start, create an admin token and print it: the only time it is ever shown."""
    conn = await db.connect(dsn)
    try:
        async with conn.transaction():
            await conn.execute("LOCK TABLE api_tokens IN SHARE ROW EXCLUSIVE MODE")
            if await conn.fetchval(sql("count_admin_tokens")):
                return
            token = await tokens.create_token(conn, "admin", admin=True, name="created by chimes up")
    finally:
        await conn.close()
    click.echo(
        "\nThis is the admin token; it is shown only now, so keep it:\n\n"
        f"    {token}\n\n"
        "More tokens: chimes token create --owner TEAM [--admin]\n"
    )
