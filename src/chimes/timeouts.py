"""Waiting with a deadline without losing a cancellation.

``asyncio.wait_for`` in Python 3.11 returns normally when the task is cancelled in the same loop
iteration as the awaited thing completes (python/cpython#86296): the cancellation is lost. A loop
that waits that way while it is cancelled on shutdown keeps running, and the shutdown hangs (a
scheduler node did, once, in the test suite). ``asyncio.timeout`` delivers the cancellation.
"""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, seconds: float) -> bool:
    """Wait until ``event`` is set or ``seconds`` pass; True if it was set."""
    try:
        async with asyncio.timeout(max(0.0, seconds)):
            await event.wait()
    except TimeoutError:
        return False
    return True
