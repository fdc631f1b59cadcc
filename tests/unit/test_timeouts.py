"""chimes.timeouts.wait_event: a deadline that never swallows a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from chimes.timeouts import wait_event


async def test_a_cancellation_that_arrives_as_the_event_is_set_is_delivered() -> None:
    # asyncio.wait_for(event.wait(), ...) returns normally here on Python 3.11 (python/cpython#86296):
    # a loop cancelled on shutdown just then went on, and a scheduler node's stop hung.
    event = asyncio.Event()
    waiting = asyncio.create_task(wait_event(event, 10))
    await asyncio.sleep(0)  # it waits now
    event.set()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_says_whether_the_event_was_set_or_the_time_ran_out() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    assert await wait_event(event, -1) is False  # a deadline already past: no wait at all
    event.set()
    assert await wait_event(event, 10) is True
