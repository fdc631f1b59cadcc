"""Identifiers: job ids, deterministic run ids and the partition hash.

Run ids of a schedule's slots are derived from ``(job_id, scheduled_at)`` so that firing the same
slot twice can only ever produce one run: the second insert collides on the primary key. Runs asked
for by a person (a manual run, a re-run) are not slots: each gets random bits instead, so two asked
for in the same millisecond, or at a slot's millisecond, stay two runs. In both, the first 48 bits
carry the scheduled time in milliseconds (the UUIDv7 layout), which keeps run ids time-ordered and
lets a lookup by id prune the time partitions of the runs table.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
import zlib
from datetime import UTC, datetime, timedelta

from chimes.instants import in_utc

PARTITION_COUNT = 1024
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def partition_of(job_id: uuid.UUID) -> int:
    """The trigger partition of a job: CRC32 of its id bytes, stable across processes and versions."""
    return zlib.crc32(job_id.bytes) % PARTITION_COUNT


def new_job_id() -> uuid.UUID:
    """A time-ordered random id (UUIDv7 layout), so listing by id lists in creation order."""
    return _v7(int(time.time() * 1000), os.urandom(10))


def new_job_id_in(partition: int) -> uuid.UUID:
    """A job id as :func:`new_job_id` makes them whose partition is ``partition``: random ids are drawn
    until one falls there (1,024 on average, a millisecond or two). Used where a job's partition must
    follow from something else than chance (an idempotency key, with shards: docs/scaling.md)."""
    if not 0 <= partition < PARTITION_COUNT:
        raise ValueError(f"partition {partition}: must lie within 0-{PARTITION_COUNT - 1}")
    millis = int(time.time() * 1000)
    while True:
        for job_id in new_job_ids(256, millis):
            if partition_of(job_id) == partition:
                return job_id


def partition_of_key(owner: str, key: str) -> int:
    """The partition of the jobs an owner creates with an idempotency key: retries of a create land
    on the partition, so the shard, where the first one was made.

    A real hash, not CRC-32: CRC is linear, so keys that differ in a counter (``order-000``,
    ``order-001``, ...) would fall into the same half of the partitions in long runs, and a client
    numbering its keys would put whole batches of jobs on one shard."""
    digest = hashlib.blake2b(owner.encode() + b"\0" + key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % PARTITION_COUNT


def new_job_ids(count: int, millis: int | None = None) -> list[uuid.UUID]:
    """``count`` ids as :func:`new_job_id` makes them (at ``millis``, default now), ascending: creation
    order, and appends to the primary key index rather than splits. One call for the random bytes of
    all (the bulk importer: a system call per id was a tenth of its time)."""
    millis = int(time.time() * 1000) if millis is None else millis
    tails = os.urandom(10 * count)
    return sorted(_v7(millis, tails[i:i + 10]) for i in range(0, 10 * count, 10))


# The times a run can be scheduled at: a run id holds milliseconds since 1970 (none before), and
# PostgreSQL and Python must both round-trip the time (Python's end at year 9999 is the nearer one;
# PostgreSQL stores years 1 and earlier as -infinity).
EARLIEST_SCHEDULABLE = _EPOCH
LATEST_SCHEDULABLE = datetime(9999, 1, 1, tzinfo=UTC)


def schedulable(instant: datetime) -> datetime:
    """``instant`` in UTC, if a run can be scheduled at it; else ValueError saying what can be."""
    try:
        utc: datetime | None = in_utc(instant)
    except ValueError:  # past the calendar's ends once in UTC
        utc = None
    if utc is None or not EARLIEST_SCHEDULABLE <= utc < LATEST_SCHEDULABLE:
        raise ValueError(f"is outside the times Chimes can schedule: from {EARLIEST_SCHEDULABLE:%Y-%m-%dT%H:%M:%SZ} "
                         f"up to (not including) {LATEST_SCHEDULABLE:%Y-%m-%dT%H:%M:%SZ}")
    return utc


def truncate_to_millis(instant: datetime) -> datetime:
    """Run times are kept at millisecond precision: the run id encodes them in 48 bits of millis."""
    return instant.replace(microsecond=instant.microsecond // 1000 * 1000)


def run_id_for(job_id: uuid.UUID, scheduled_at: datetime) -> uuid.UUID:
    """The one run id of a job's slot. ``scheduled_at`` must already be truncated to milliseconds."""
    millis = _millis(scheduled_at)
    digest = hashlib.blake2b(job_id.bytes + millis.to_bytes(8, "big"), digest_size=10).digest()
    return _v7(millis, digest)


def new_run_id(scheduled_at: datetime) -> uuid.UUID:
    """A run id of its own for a run that is not a slot (manual, re-run), scheduled at
    ``scheduled_at`` (already truncated to milliseconds): random bits after the time, so it never
    takes the id of a slot or of another such run."""
    return _v7(_millis(scheduled_at), os.urandom(10))


def scheduled_at_of(run_id: uuid.UUID) -> datetime:
    """The scheduled time encoded in a run id (see :func:`run_id_for`)."""
    return _EPOCH + timedelta(milliseconds=run_id.int >> 80)


def scheduled_at_of_or_none(run_id: uuid.UUID) -> datetime | None:
    """Like :func:`scheduled_at_of`, for ids from outside: None when the time cannot be a date."""
    try:
        return scheduled_at_of(run_id)
    except OverflowError:
        return None


def id_from(text: str) -> uuid.UUID | None:
    """An id given from outside (a URL, a form), or None when it is not a UUID. The API and the
    dashboard both read ids this way: a malformed id names nothing, like another team's."""
    try:
        return uuid.UUID(text)
    except ValueError:
        return None


def run_id_from(text: str) -> uuid.UUID | None:
    """A run id given from outside, or None when it names no run: not a UUID, not version 7, or a time
    past year 9999 (which no store query could take)."""
    run_id = id_from(text)
    if run_id is None or run_id.version != 7 or scheduled_at_of_or_none(run_id) is None:
        return None
    return run_id


def _millis(instant: datetime) -> int:
    delta = instant - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


def _v7(millis: int, tail: bytes) -> uuid.UUID:
    rand = int.from_bytes(tail, "big")
    value = (millis & ((1 << 48) - 1)) << 80 | rand
    value = (value & ~(0xF << 76)) | (0x7 << 76)  # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # RFC 4122 variant
    return uuid.UUID(int=value)
