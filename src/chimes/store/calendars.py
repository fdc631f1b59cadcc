"""Exclusion calendars in the catalog database (chimes.calendars): written through the API, read by
scheduler nodes."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from chimes.calendars import Calendar, CalendarSpec
from chimes.store.db import Conn, Pool, one_row
from chimes.store.queries import sql


@dataclass(frozen=True, slots=True)
class CalendarRecord:
    owner: str
    name: str
    spec: CalendarSpec
    version: int
    updated_at: datetime


def _spec(row: Any) -> CalendarSpec:
    return CalendarSpec(timezone=row["timezone"], dates=list(row["dates"]), windows=row["windows"])


def _record(row: Any) -> CalendarRecord:
    return CalendarRecord(row["owner"], row["name"], _spec(row), row["version"], row["updated_at"])


async def put_calendar(conn: Conn | Pool, owner: str, name: str, spec: CalendarSpec) -> tuple[int, bool]:
    """Create or replace; returns the new version and whether it was created."""
    wire = spec.to_wire()
    row = one_row(await conn.fetchrow(sql("put_calendar"), owner, name, spec.timezone, list(spec.dates),
                                      wire["windows"]))
    return row["version"], row["created"]


async def get_calendar(conn: Conn | Pool, owner: str, name: str) -> CalendarRecord | None:
    row = await conn.fetchrow(sql("get_calendar"), owner, name)
    return None if row is None else _record(row)


async def list_calendars(conn: Conn | Pool, owner: str | None) -> list[CalendarRecord]:
    return [_record(row) for row in await conn.fetch(sql("list_calendars"), owner)]


async def lock_calendar(conn: Conn, owner: str, name: str) -> bool:
    """Lock the calendar's row until the transaction ends; False when there is none."""
    return await conn.fetchval(sql("lock_calendar"), owner, name) is not None


async def delete_calendar(conn: Conn, owner: str, name: str) -> bool:
    return await conn.fetchval(sql("delete_calendar"), owner, name) is not None


async def missing_calendars(conn: Conn, owner: str, names: Sequence[str]) -> list[str]:
    """Of ``names``, those the owner has no calendar by; locks the others (FOR SHARE) until the
    transaction ends, so none of them is deleted before the job referring to it is written."""
    await conn.execute(sql("share_calendars"), owner, list(names))
    return [row["name"] for row in await conn.fetch(sql("missing_calendars"), owner, list(names))]


async def jobs_using_calendar(conn: Conn | Pool, owner: str, name: str, limit: int) -> list[uuid.UUID]:
    return [row["job_id"] for row in await conn.fetch(sql("jobs_using_calendar"), owner, name, limit)]


async def calendars_named(conn: Conn | Pool, owner: str, names: Sequence[str]) -> list[Calendar]:
    """The owner's calendars by these names, in their order; names it has no calendar by are left out."""
    records = {r.name: r for r in await list_calendars(conn, owner)}
    return [Calendar.of(name, records[name].spec) for name in names if name in records]


async def calendar_fingerprint(conn: Conn | Pool) -> tuple[int, int]:
    """The newest version and the number of calendars: either changes with every write or delete."""
    row = one_row(await conn.fetchrow(sql("calendar_fingerprint")))
    return row["version"], row["calendars"]


async def all_calendars(conn: Conn | Pool) -> dict[tuple[str, str], Calendar]:
    return {(row["owner"], row["name"]): Calendar.of(row["name"], _spec(row))
            for row in await conn.fetch(sql("all_calendars"))}
