"""An API server's heartbeat in ``api_servers`` on the catalog, with its release: what lets
``chimes migrate --contract`` see that an older API server still runs (chimes.store.upgrades)."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid

from chimes import failures
from chimes.store import db, upgrades

API_HEARTBEAT_SEC = 10.0  # live for 30 s unrenewed (store/sql/upgrades.sql, live_processes)


def new_server_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


async def heartbeat(pool: db.Pool, server_id: str, every_sec: float = API_HEARTBEAT_SEC) -> None:
    """Until cancelled; a failed heartbeat is logged and tried again (the API serves on meanwhile)."""
    hostname, pid = socket.gethostname(), os.getpid()
    try:
        await upgrades.forget_dead_api_servers(pool)
    except db.DB_ERRORS as exc:
        failures.loop_failed("api", "heartbeat", exc)
    while True:
        try:
            await upgrades.heartbeat_api_server(pool, server_id, hostname, pid)
        except db.DB_ERRORS as exc:
            failures.loop_failed("api", "heartbeat", exc)
        await asyncio.sleep(every_sec)


async def leave(pool: db.Pool, server_id: str) -> None:
    """Forget this server at a graceful stop, so that a contract step need not wait for its row to age."""
    try:
        await upgrades.forget_api_server(pool, server_id)
    except db.DB_ERRORS as exc:
        failures.loop_failed("api", "heartbeat", exc)
