"""The audit trail: who changed what, when, under which request (migration 0017).

:func:`record` is the one way in: every state-changing call passes the connection of the transaction
that makes its change, so the entry commits with the change or not at all. Values are compared as the
database keeps them (sealed secrets sealed), then shown through the caller's ``shown`` (a job's
change passes :func:`chimes.security.secrets.redact`): an entry never holds a secret, sealed or clear,
and a changed secret shows as a changed field with both sides ``********``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from chimes.store.db import Conn
from chimes.store.queries import bind, sql


@dataclass(frozen=True, slots=True)
class Actor:
    """Who made a change: a token (its id and name) of an owner, or the command line (no token; the
    operating-system user as ``name``)."""

    owner: str
    token_id: uuid.UUID | None = None
    name: str | None = None


@dataclass(frozen=True, slots=True)
class AuditNote:
    """The who, when and which request of a change, handed down to where the change is written."""

    actor: Actor
    at: datetime
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class AuditEntry:
    entry_id: uuid.UUID
    at: datetime
    actor_token: uuid.UUID | None
    actor_name: str | None
    actor_owner: str
    request_id: str | None
    action: str
    subject: str
    job_id: uuid.UUID | None
    subject_owner: str | None
    changes: dict[str, Any]


Shown = Callable[[dict[str, Any]], dict[str, Any]]


def _as_is(fields: dict[str, Any]) -> dict[str, Any]:
    return fields


def changes(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None, shown: Shown = _as_is
            ) -> dict[str, Any]:
    """The fields that differ, ``{"field": {"before": x, "after": y}}``; a side that does not exist
    (a create's before, a delete's after) is None for every field. ``shown`` (redaction) is applied
    after the comparison, so a changed secret still shows as changed."""
    old, new = dict(before or {}), dict(after or {})
    differing = [key for key in {**old, **new} if old.get(key) != new.get(key)]
    old_shown, new_shown = shown(old), shown(new)
    return {key: {"before": old_shown.get(key), "after": new_shown.get(key)} for key in sorted(differing)}


async def record(conn: Conn, note: AuditNote, action: str, subject: str, before: Mapping[str, Any] | None,
                 after: Mapping[str, Any] | None, *, job_id: uuid.UUID | None = None,
                 subject_owner: str | None = None, shown: Shown = _as_is) -> None:
    """Write one entry in the caller's transaction (``conn``): ``action`` such as ``job.update``,
    ``subject`` such as ``job <id>``; ``before``/``after`` the subject's fields around the change."""
    text, args = bind("insert_audit_entry", entry_id=uuid.uuid4(), at=note.at, actor_token=note.actor.token_id,
                      actor_name=note.actor.name, actor_owner=note.actor.owner, request_id=note.request_id,
                      action=action, subject=subject, job_id=job_id, subject_owner=subject_owner,
                      changes=changes(before, after, shown))
    await conn.execute(text, *args)


@dataclass(frozen=True, slots=True)
class AuditFilter:
    """What ``GET /audit`` asks for; None: no restriction. ``subject_owner``: an owner's token sees
    only entries about its own things."""

    subject_owner: str | None = None
    actor: str | None = None
    job_id: uuid.UUID | None = None
    action: str | None = None
    since: datetime | None = None
    until: datetime | None = None


async def list_entries(conn: Conn, where: AuditFilter, after: tuple[datetime, uuid.UUID] | None,
                       limit: int) -> list[AuditEntry]:
    """Newest first, after the cursor (the last entry's time and id)."""
    rows = await conn.fetch(sql("list_audit_entries"), after[0] if after else None, after[1] if after else None,
                            where.subject_owner, where.actor, where.job_id, where.action, where.since,
                            where.until, limit)
    return [AuditEntry(**dict(row)) for row in rows]


async def delete_older_than(conn: Conn, cutoff: datetime, batch: int) -> int:
    status: str = await conn.execute(sql("delete_old_audit_entries"), cutoff, batch)
    return int(status.split()[-1])
