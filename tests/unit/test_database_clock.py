"""A node's estimate of the database's clock: never ahead of it, and not misled by a slow sample."""

from __future__ import annotations

import pytest

from chimes.clock import Clock
from chimes.scheduler.database_clock import DatabaseClock
from chimes.store.scheduling import ClockSample


def test_before_any_sample_it_is_the_host_clock() -> None:
    clock = DatabaseClock(Clock())
    assert clock.offset_sec == 0.0


def test_the_offset_is_the_bound_that_keeps_the_node_behind_the_database() -> None:
    clock = DatabaseClock(Clock())
    # The database read 100.0 somewhere between the host's 101.990 and 102.010: its clock is
    # between 1.990 and 2.010 s behind; taking 2.010 the node can be late by 20 ms, never early.
    clock.record(ClockSample(sent=101.990, database=100.0, received=102.010))
    assert clock.offset_sec == pytest.approx(-2.010)


def test_the_sample_with_the_shortest_round_trip_wins() -> None:
    clock = DatabaseClock(Clock())
    clock.record(ClockSample(sent=10.0, database=9.0, received=10.002))  # 2 ms round trip
    clock.record(ClockSample(sent=20.0, database=19.0, received=20.500))  # a busy database: 500 ms
    assert clock.offset_sec == pytest.approx(-1.002)
    clock.record(ClockSample(sent=30.0, database=29.0, received=30.001))
    assert clock.offset_sec == pytest.approx(-1.001)


def test_old_samples_are_forgotten_so_a_changed_clock_is_followed() -> None:
    clock = DatabaseClock(Clock())
    clock.record(ClockSample(sent=0.0, database=0.0, received=0.0001))
    for second in range(1, 17):  # the host's clock was stepped 3 s back, samples a little slower
        clock.record(ClockSample(sent=second, database=second + 3.0, received=second + 0.01))
    assert clock.offset_sec == pytest.approx(2.99)


def test_a_sample_across_a_clock_step_backwards_is_ignored() -> None:
    clock = DatabaseClock(Clock())
    clock.record(ClockSample(sent=50.0, database=40.0, received=49.0))
    assert clock.offset_sec == 0.0


def test_time_follows_the_offset_only_when_told_to() -> None:
    following, not_following = DatabaseClock(Clock(offset_sec=5.0)), DatabaseClock(Clock(offset_sec=5.0), follow=False)
    for clock in (following, not_following):
        sent = clock.host.time()
        clock.record(ClockSample(sent=sent, database=sent - 5.0, received=sent))
    host = Clock().time()
    assert abs(following.time() - host) < 0.5  # the database's clock, as Clock() is the real one
    assert abs(not_following.time() - (host + 5.0)) < 0.5
