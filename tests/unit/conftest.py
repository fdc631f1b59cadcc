"""Fixtures of the unit tests that several files share."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from chimes.worker.tasks.http import HttpExecutor


@pytest.fixture
async def http() -> AsyncIterator[HttpExecutor]:
    """An HTTP task executor of 10 connections a pool, closed after the test."""
    executor = HttpExecutor(max_connections=10)
    try:
        yield executor
    finally:
        await executor.close()
