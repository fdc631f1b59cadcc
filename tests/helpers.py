"""Small helpers for tests: waiting on conditions with deadlines, ports, auth headers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any


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


