"""Exclusion calendars in the catalog database (chimes.calendars): written through the API, read by
scheduler nodes and by the API's previews.

Rows are read as text and parsed one at a time (Calendar.stored): a row that does not parse is that
calendar's problem (it excludes every slot of the jobs naming it), never a failed read of the others."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson

from chimes.calendars import Calendar, CalendarSpec, named
from chimes.store.db import Conn, Pool, one_row
from chimes.store.queries import sql

CalendarKey = tuple[str, str]  # (owner, name)


@dataclass(frozen=True, slots=True)
class CalendarRecord:
    """A calendar as stored: ``shown`` is its timezone, dates and windows in the wire form, as they
    were written (even when they no longer parse: ``calendar`` then says why)."""

    owner: str
    name: str
    shown: dict[str, Any]
    calendar: Calendar
    version: int
    updated_at: datetime


def _windows(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text  # shown as stored; not a list of windows, so the calendar does not parse


def _calendar(row: Any) -> Calendar:
    return Calendar.stored(row["name"], row["timezone"], row["dates"], _windows(row["windows"]))


def _record(row: Any) -> CalendarRecord:
    shown = {"timezone": row["timezone"], "dates": list(row["dates"]), "windows": _windows(row["windows"])}
    return CalendarRecord(row["owner"], row["name"], shown, _calendar(row), row["version"], row["updated_at"])


async def put_calendar(conn: Conn | Pool, owner: str, name: str, spec: CalendarSpec) -> tuple[int, bool]:
    """Create or replace; returns the calendar's new version and whether it was created."""
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


async def calendars_of_owners(conn: Conn | Pool, owners: Sequence[str]) -> dict[CalendarKey, Calendar]:
    """Every calendar of these owners, by (owner, name)."""
    if not owners:
        return {}
    rows = await conn.fetch(sql("calendars_of_owners"), list(dict.fromkeys(owners)))
    return {(row["owner"], row["name"]): _calendar(row) for row in rows}


async def calendars_named(conn: Conn | Pool, owner: str, names: Sequence[str]) -> list[Calendar]:
    """The owner's calendars by these names, in their order, as the scheduler asks them: a name it has
    no calendar by, or one that does not parse, is an unusable calendar that excludes every slot."""
    if not names:
        return []
    return named(await calendars_of_owners(conn, [owner]), owner, names)


def calendars_of_job(calendars: Mapping[CalendarKey, Calendar], owner: str, definition: Mapping[str, Any]
                     ) -> list[Calendar]:
    """The calendars a job's stored definition names, from those of its owner read before."""
    return named(calendars, owner, definition["schedule"].get("excludeCalendars") or [])


async def calendar_fingerprint(conn: Conn | Pool) -> tuple[Any, int]:
    """The sum of the calendars' changes and their count: one of them changes with every write or delete."""
    row = one_row(await conn.fetchrow(sql("calendar_fingerprint")))
    return row["changes"], row["calendars"]


async def calendar_changes(conn: Conn | Pool) -> dict[CalendarKey, int]:
    """Each calendar's last change, by (owner, name)."""
    return {(row["owner"], row["name"]): row["change"] for row in await conn.fetch(sql("calendar_changes"))}


async def calendars_by_key(conn: Conn | Pool, keys: Sequence[CalendarKey]) -> dict[CalendarKey, tuple[int, Calendar]]:
    """These calendars with the change each was read at, by (owner, name); a key none has is left out."""
    if not keys:
        return {}
    rows = await conn.fetch(sql("calendars_by_key"), [owner for owner, _ in keys], [name for _, name in keys])
    return {(row["owner"], row["name"]): (row["change"], _calendar(row)) for row in rows}
