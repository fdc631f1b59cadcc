"""Tests for chimes.ids: the partition hash, deterministic run ids and time-ordered job ids."""

from __future__ import annotations

import collections
import random
import time
import uuid
import zlib
from datetime import UTC, datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from chimes.ids import (
    PARTITION_COUNT,
    id_from,
    new_job_id,
    new_job_ids,
    partition_of,
    run_id_for,
    run_id_from,
    scheduled_at_of,
    truncate_to_millis,
)

JOB_A = uuid.UUID("12345678-1234-5678-1234-567812345678")
JOB_B = uuid.UUID("0190a3b2-7c4d-7e5f-8a6b-9c0d1e2f3a4b")


@pytest.mark.parametrize(
    ("job_id", "expected"),
    [
        (uuid.UUID(int=0), 853),  # crc32 = 3971697493
        (JOB_A, 400),  # crc32 = 1773289872
        (uuid.UUID("ffffffff-ffff-ffff-ffff-ffffffffffff"), 538),  # crc32 = 1068746266
        (JOB_B, 295),  # crc32 = 1526082855
    ],
)
def test_partition_of_is_stable(job_id: uuid.UUID, expected: int) -> None:
    assert zlib.crc32(job_id.bytes) % 1024 == expected
    assert partition_of(job_id) == expected


def test_partition_of_is_roughly_even_over_random_ids() -> None:
    rng = random.Random(20240229)
    counts = collections.Counter(partition_of(uuid.UUID(int=rng.getrandbits(128))) for _ in range(100_000))
    assert PARTITION_COUNT == 1024
    assert all(0 <= p < PARTITION_COUNT for p in counts)
    assert len(counts) == PARTITION_COUNT  # every partition hit (~98 expected each)
    assert max(counts.values()) / min(counts.values()) < 3


def z(*args: int, us: int = 0) -> datetime:
    return datetime(*args, microsecond=us, tzinfo=UTC)


SLOTS = [
    z(1970, 1, 1),  # the epoch: zero millis
    z(2000, 1, 1, 0, 0, 0, us=1000),
    z(2024, 2, 29, 12, 30, 15, us=123000),  # leap day
    z(2026, 3, 8, 7),
    z(2037, 12, 31, 23, 59, 59, us=999000),  # before 2038
    z(2038, 1, 19, 3, 14, 8),  # just past the 32-bit seconds limit
    z(2100, 3, 1, 0, 0, 0, us=500000),
    z(9999, 12, 31, 23, 59, 59, us=999000),
]


@pytest.mark.parametrize("slot", SLOTS, ids=lambda t: t.isoformat())
def test_run_id_round_trips_scheduled_time(slot: datetime) -> None:
    run_id = run_id_for(JOB_A, slot)
    assert run_id.version == 7
    assert run_id.variant == uuid.RFC_4122
    assert run_id.int >> 80 == (slot - z(1970, 1, 1)) // timedelta(milliseconds=1)
    decoded = scheduled_at_of(run_id)
    assert decoded == slot
    assert decoded.utcoffset() == timedelta(0)


def test_run_id_round_trips_a_non_utc_instant() -> None:
    slot = datetime(2030, 6, 1, 12, 0, 0, 250000, tzinfo=ZoneInfo("Europe/Berlin"))
    assert scheduled_at_of(run_id_for(JOB_B, slot)) == z(2030, 6, 1, 10, 0, 0, us=250000)


def test_run_id_is_deterministic_and_distinct() -> None:
    ids = {(job, slot): run_id_for(job, slot) for job in (JOB_A, JOB_B) for slot in SLOTS}
    for (job, slot), run_id in ids.items():
        assert run_id_for(uuid.UUID(str(job)), slot) == run_id
    assert len(set(ids.values())) == len(ids)


def test_run_id_differs_for_adjacent_millis() -> None:
    t = z(2026, 1, 1)
    a, b = run_id_for(JOB_A, t), run_id_for(JOB_A, t + timedelta(milliseconds=1))
    assert a != b
    assert a < b  # time-ordered


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (z(2026, 1, 1, us=0), z(2026, 1, 1, us=0)),
        (z(2026, 1, 1, us=999), z(2026, 1, 1, us=0)),
        (z(2026, 1, 1, us=1000), z(2026, 1, 1, us=1000)),
        (z(2026, 1, 1, us=123456), z(2026, 1, 1, us=123000)),
        (z(2026, 1, 1, us=999999), z(2026, 1, 1, us=999000)),
    ],
)
def test_truncate_to_millis(given: datetime, expected: datetime) -> None:
    assert truncate_to_millis(given) == expected


def test_truncate_to_millis_keeps_zone() -> None:
    zone = timezone(timedelta(hours=5, minutes=30))
    got = truncate_to_millis(datetime(2026, 5, 5, 1, 2, 3, 456789, tzinfo=zone))
    assert got.tzinfo is zone
    assert got == datetime(2026, 5, 5, 1, 2, 3, 456000, tzinfo=zone)


def test_new_job_ids_sort_in_creation_order() -> None:
    ids = []
    deadline = time.monotonic() + 5
    for _ in range(5):
        start_ms = int(time.time() * 1000)
        ids.append(new_job_id())
        while int(time.time() * 1000) < start_ms + 2:  # busy-wait: at least 2 ms later
            assert time.monotonic() < deadline, "clock did not advance"
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    for job_id in ids:
        assert job_id.version == 7
        assert job_id.variant == uuid.RFC_4122
        assert abs(scheduled_at_of(job_id) - datetime.now(UTC)) < timedelta(seconds=5)


def test_new_job_ids_in_bulk_are_distinct_version_7_ids_of_now() -> None:
    ids = new_job_ids(1000)
    assert ids == sorted(ids)  # in creation order, as one at a time
    assert len(set(ids)) == 1000
    assert {(job_id.version, job_id.variant) for job_id in ids} == {(7, uuid.RFC_4122)}
    assert all(abs(scheduled_at_of(job_id) - datetime.now(UTC)) < timedelta(seconds=5) for job_id in ids)
    assert new_job_ids(0) == []
    at = int(datetime(2026, 12, 1, tzinfo=UTC).timestamp() * 1000)
    assert {scheduled_at_of(job_id) for job_id in new_job_ids(3, at)} == {datetime(2026, 12, 1, tzinfo=UTC)}


def test_id_from_text_accepts_any_uuid_and_nothing_else() -> None:
    job_id = uuid.uuid4()
    assert id_from(str(job_id)) == job_id
    assert id_from(job_id.hex) == job_id  # uuid.UUID's other spelling, as the API always took it
    for text in ("", "not-a-uuid", str(job_id)[:-1], str(job_id) + "0"):
        assert id_from(text) is None, text


def test_run_id_from_text_accepts_only_run_ids() -> None:
    run_id = run_id_for(uuid.uuid4(), datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC))
    assert run_id_from(str(run_id)) == run_id
    for text in ("", "not-a-uuid", str(uuid.uuid4()), "ffffffff-ffff-7fff-bfff-ffffffffffff"):
        assert run_id_from(text) is None, text
