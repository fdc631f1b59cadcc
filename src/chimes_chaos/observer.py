"""Watching partition ownership during a chaos run: who held which partition, with which token, when.

The observer reads ``partition_leases`` every ~200 ms and keeps, per partition, the *spans* of each
fencing token: when it was first seen, the last time it was seen valid (owned and unexpired, by the
database's clock), and the first time it was seen gone for good (another token, or released). A token
that merely expired may be renewed by its owner if nobody took it, so only a new token or a release
ends a span.

With shards every database has its own 1,024 lease rows, one set per home: one observer watches
each home, keeping only the partitions that home holds (the others are empty there), and
:meth:`LeaseObserver.merged` joins them into one view in which each partition is watched where it lives.
With partition moves (``--moves``) a partition changes home during the run: each observer then keeps
every partition of its home, and the checks read a partition's spans on the home that held it at the
moment they judge (``Evidence.home_at``). A lease row a move closed (owner ``move N``) is a span like
any other: it ends the span of the node that held the partition, as a takeover would.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg

from chimes.store.db import DB_ERRORS

log = logging.getLogger(__name__)

# A lease row a partition move closed expires at 'infinity' (one it opened: '-infinity'), which asyncpg
# decodes to a datetime without a zone: clamped to a century either way.
POLL_SQL = """
SELECT now() AS seen, partition_id, owner, token,
       least(greatest(expires_at, now() - interval '100 years'), now() + interval '100 years') AS expires_at
FROM partition_leases
"""


@dataclass(slots=True)
class Span:
    partition: int
    token: int
    owner: str
    first_seen: datetime
    last_valid: datetime | None = None
    ended_seen: datetime | None = None  # first observation showing another token or a release
    home: int = 0  # the database whose lease row it is (0: the catalog)


@dataclass
class LeaseObserver:
    dsn: str
    every_sec: float = 0.2
    spans: dict[int, list[Span]] = field(default_factory=dict)
    polls: int = 0
    failed_polls: int = 0
    partitions: range | None = None  # only these (a shard's range); None: every partition
    home: int = 0  # which database it watches (0: the catalog), recorded in its spans

    @classmethod
    def merged(cls, observers: list[LeaseObserver]) -> LeaseObserver:
        """One view of several homes' observers, whose partitions do not overlap."""
        if len(observers) == 1:
            return observers[0]
        view = cls("", polls=sum(o.polls for o in observers), failed_polls=sum(o.failed_polls for o in observers))
        for observer in observers:
            view.spans |= observer.spans
        return view

    async def run(self, stop: asyncio.Event) -> None:
        conn: asyncpg.Connection | None = None
        while not stop.is_set():
            try:
                if conn is None or conn.is_closed():
                    conn = await asyncpg.connect(self.dsn, timeout=2)
                self.observe(await conn.fetch(POLL_SQL, timeout=2))
            except DB_ERRORS:  # asyncpg's InternalClientError too: it ended a 30-minute run once
                self.failed_polls += 1  # the database is restarting: nobody can change leases either
                if conn is not None:
                    conn.terminate()
                conn = None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.every_sec)
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    def observe(self, rows: list[asyncpg.Record] | list[dict[str, Any]]) -> None:
        self.polls += 1
        for row in rows:
            seen, partition, owner, token = row["seen"], row["partition_id"], row["owner"], row["token"]
            if self.partitions is not None and partition not in self.partitions:
                continue
            history = self.spans.setdefault(partition, [])
            current = history[-1] if history and history[-1].ended_seen is None else None
            if current is not None and (current.token != token or owner is None):
                current.ended_seen = seen
                current = None
            if owner is None:
                continue
            if current is None:
                if history and history[-1].token == token and history[-1].owner == owner:
                    continue  # a released span stays ended
                current = Span(partition, token, owner, seen, home=self.home)
                history.append(current)
            if row["expires_at"] > seen:
                current.last_valid = seen

    def held_at(self, owner: str, moment: datetime) -> dict[int, Span]:
        """The spans ``owner`` held at ``moment`` (seen valid before it and not seen ended by then)."""
        held = {}
        for partition, history in self.spans.items():
            index = bisect.bisect_right(history, moment, key=lambda span: span.first_seen) - 1
            if index < 0:
                continue
            span = history[index]
            if span.owner == owner and span.last_valid is not None and (
                    span.ended_seen is None or span.ended_seen > moment):
                held[partition] = span
        return held

    def next_span(self, span: Span) -> Span | None:
        """The span that followed ``span`` in its partition, if any was seen."""
        history = self.spans.get(span.partition, [])
        index = bisect.bisect_right(history, span.first_seen, key=lambda other: other.first_seen)
        return history[index] if index < len(history) else None
