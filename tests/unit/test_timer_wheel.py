"""Tests for chimes.scheduler.timer_wheel: the in-memory heap of due triggers."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from chimes.enums import TriggerKind
from chimes.scheduler import timer_wheel
from chimes.scheduler.timer_wheel import TimerWheel
from chimes.store.scheduling import DueTrigger

T0 = datetime(2026, 1, 1, 12, tzinfo=UTC)


def trig(n: int, offset_sec: float, partition: int = 1) -> DueTrigger:
    return DueTrigger(partition_id=partition, fire_at=T0 + timedelta(seconds=offset_sec), trigger_id=uuid.UUID(int=n),
                      job_id=uuid.UUID(int=1000 + n),
                      job_version=1, kind=TriggerKind.SCHEDULE, cron="* * * * *", timezone="UTC")


def at(offset_sec: float) -> float:
    return (T0 + timedelta(seconds=offset_sec)).timestamp()


def ids(triggers: list[DueTrigger]) -> list[int]:
    return [t.trigger_id.int for t in triggers]


def test_count_due_counts_what_pop_due_would_take_up_to_enough() -> None:
    wheel = TimerWheel()
    offsets = [7, 1, 3, 3, 9, 2, 3, 8, 5, 3, 6, 4, 3]  # heap order is not fire order
    wheel.add_all(trig(n, offset) for n, offset in enumerate(offsets))
    for until in (0, 1, 2.5, 3, 4, 8.9, 9, 100):
        due = sum(offset <= until for offset in offsets)
        assert wheel.count_due(at(until), enough=100) == due
        assert wheel.count_due(at(until), enough=3) == min(due, 3)
    assert wheel.count_due(at(3), enough=100) == len(wheel.pop_due(at(3)))


def test_pop_due_returns_only_due_in_fire_order() -> None:
    wheel = TimerWheel()
    assert wheel.add_all([trig(3, 3), trig(1, 1), trig(5, 5), trig(2, 2), trig(4, 4)]) == 5
    assert ids(wheel.pop_due(at(0.5))) == []
    assert ids(wheel.pop_due(at(3))) == [1, 2, 3]  # due at exactly now counts
    assert len(wheel) == 2
    assert ids(wheel.pop_due(at(100))) == [4, 5]
    assert len(wheel) == 0


def test_ties_keep_insertion_order() -> None:
    wheel = TimerWheel()
    wheel.add_all([trig(9, 1), trig(2, 1), trig(5, 1)])
    assert ids(wheel.pop_due(at(1))) == [9, 2, 5]


def test_pop_due_respects_limit() -> None:
    wheel = TimerWheel()
    wheel.add_all([trig(n, n) for n in range(1, 6)])
    assert ids(wheel.pop_due(at(10), limit=2)) == [1, 2]
    assert ids(wheel.pop_due(at(10), limit=0)) == []
    assert ids(wheel.pop_due(at(10), limit=10)) == [3, 4, 5]


def test_add_dedupes_by_key() -> None:
    wheel = TimerWheel()
    assert wheel.add(trig(1, 1)) is True
    assert wheel.add(trig(1, 1)) is False
    assert wheel.add_all([trig(1, 1), trig(2, 2)]) == 1
    assert len(wheel) == 2
    assert ids(wheel.pop_due(at(5))) == [1, 2]


def test_in_flight_keys_are_not_re_added_until_done() -> None:
    wheel = TimerWheel()
    wheel.add(trig(1, 1))
    popped = wheel.pop_due(at(1))
    assert ids(popped) == [1]
    assert trig(1, 1).key in wheel
    assert wheel.add(trig(1, 1)) is False
    assert wheel.pop_due(at(10)) == []
    wheel.done(popped)
    assert trig(1, 1).key not in wheel
    assert wheel.add(trig(1, 1)) is True
    assert ids(wheel.pop_due(at(10))) == [1]


def test_drop_partitions_forgets_their_triggers() -> None:
    wheel = TimerWheel()
    wheel.add_all([trig(1, 1, partition=7), trig(2, 2, partition=8), trig(3, 3, partition=9),
                   trig(4, 4, partition=7)])
    assert wheel.drop_partitions({7, 9}) == 3
    assert len(wheel) == 1
    assert trig(1, 1, partition=7).key not in wheel
    assert ids(wheel.pop_due(at(100))) == [2]
    assert wheel.pop_due(at(100)) == []


def test_dropped_trigger_can_be_held_again() -> None:
    wheel = TimerWheel()
    wheel.add(trig(1, 1, partition=7))
    wheel.drop_partitions([7])
    assert wheel.add(trig(1, 1, partition=7)) is True
    assert ids(wheel.pop_due(at(100))) == [1]  # once, despite the stale heap entry
    assert wheel.pop_due(at(100)) == []


def test_next_due() -> None:
    wheel = TimerWheel()
    assert wheel.next_due() is None
    wheel.add_all([trig(2, 2.5), trig(1, 1.25)])
    assert wheel.next_due() == at(1.25)
    wheel.pop_due(at(2))
    assert wheel.next_due() == at(2.5)
    wheel.pop_due(at(3))
    assert wheel.next_due() is None


def test_a_trigger_set_aside_is_not_held_again_until_its_job_changes_or_the_time_is_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = TimerWheel()
    bad = trig(1, 1)
    assert wheel.add(bad)
    wheel.pop_due(at(2))
    wheel.set_aside(bad)
    assert not wheel.add(bad)
    assert len(wheel) == 0
    assert wheel.add(replace(bad, job_version=2))  # edited: a fresh chance
    other = trig(2, 1)
    wheel.set_aside(other)
    later = time.monotonic() + timer_wheel.SET_ASIDE_SEC + 1
    monkeypatch.setattr(timer_wheel.time, "monotonic", lambda: later)
    assert wheel.add(other)  # tried again once the time is up


def test_a_time_that_is_no_time_changes_nothing() -> None:
    wheel = TimerWheel()
    naive = replace(trig(1, 1), fire_at=datetime(1, 1, 1))  # how asyncpg reads -infinity
    with pytest.raises((OverflowError, ValueError, OSError)):
        wheel.add(naive)
    assert len(wheel) == 0 and wheel.next_due() is None


def expected_sums(triggers: list[DueTrigger]) -> dict[int, tuple[int, int]]:
    sums: dict[int, tuple[int, int]] = {}
    for t in triggers:
        count, total = sums.get(t.partition_id, (0, 0))
        sums[t.partition_id] = (count + 1, total + timer_wheel.micros(t.fire_at))
    return sums


def test_the_sums_count_what_is_held_or_in_flight_through_every_change() -> None:
    wheel = TimerWheel()
    a, b, c, d = trig(1, 1.5, partition=7), trig(2, 2.000001, partition=7), trig(3, 3, partition=8), trig(4, 4, 9)
    wheel.add_all([a, b, c, d, a])  # a twice: counted once
    assert wheel.sums() == expected_sums([a, b, c, d])
    popped = wheel.pop_due(at(2.5))  # a, b in flight: still counted (still in the database until fired)
    assert wheel.sums() == expected_sums([a, b, c, d])
    wheel.done(popped[:1])
    wheel.done(popped[:1])  # twice: taken off once
    assert wheel.sums() == expected_sums([b, c, d])
    wheel.set_aside(b)  # in flight, then set aside
    wheel.set_aside(c)  # held, then set aside
    wheel.done([b])  # its batch ends after it was set aside: not taken off again
    assert wheel.sums() == expected_sums([d])
    wheel.add(trig(5, 5, partition=9))
    assert wheel.drop_partitions({9}) == 2
    assert wheel.sums() == {}


def test_the_sums_are_exact_to_the_microsecond() -> None:
    wheel = TimerWheel()
    late = replace(trig(1, 0), fire_at=datetime(2999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC))
    wheel.add_all([late, trig(2, 0.000001)])
    assert wheel.sums() == {1: (2, 32_503_679_999_999_999 + timer_wheel.micros(T0) + 1)}
