"""The embedded server's shared buffers follow the machine: a quarter of its memory, 128 MB to 2 GB."""

from __future__ import annotations

from chimes.store.embedded import SERVER_SETTINGS, shared_buffers_mb

GB = 2**30


def test_shared_buffers_are_a_quarter_of_memory_within_bounds() -> None:
    assert shared_buffers_mb(4 * GB) == 1024
    assert shared_buffers_mb(256 * 2**20) == 128  # a small machine still gets PostgreSQL's usual minimum
    assert shared_buffers_mb(64 * GB) == 2048  # a big one: enough for a million schedules' burst, no more
    assert SERVER_SETTINGS["shared_buffers"] == f"{shared_buffers_mb()}MB"
