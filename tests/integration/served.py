"""An API app served by uvicorn on 127.0.0.1 in the test's event loop, for tests that need their own
settings (limits, keys) rather than the ``api_url`` fixture's defaults."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from chimes.cli.runtime import api_server
from tests.helpers import free_port, wait_for


@contextlib.asynccontextmanager
async def served(app: Any, trusted_proxies: tuple[str, ...] = ()) -> AsyncIterator[str]:
    port = free_port()
    server = api_server(app, "127.0.0.1", port, trusted_proxies)
    task = asyncio.create_task(server.serve())
    await wait_for(lambda: server.started or task.done(), timeout=10, what="API start")
    if not server.started:
        await task
        raise RuntimeError("the API did not start (see the log)")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        await task
