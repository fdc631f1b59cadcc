"""The audit trail over HTTP: who changed what (``GET /audit``, docs/api.md "Audit trail"). Entries
are written by the state-changing endpoints (with :func:`chimes.api.actors.note_of`); with shards a
job's entries are on its home and the rest on the catalog, so a listing merges every home's."""

from __future__ import annotations

import asyncio
import base64
import heapq
import uuid
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request

from chimes.api import homes
from chimes.api.auth import current_principal
from chimes.api.errors import ApiError, refuse_unstorable
from chimes.api.jobs import parse_id
from chimes.api.responses import JSONResponse
from chimes.instants import Instant
from chimes.store.audit import AuditEntry, AuditFilter, list_entries
from chimes.store.tokens import Principal

router = APIRouter(tags=["audit"])
Caller = Annotated[Principal, Depends(current_principal)]
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@router.get("/audit", response_class=JSONResponse)
async def audit(
    request: Request, caller: Caller,
    actor: Annotated[str | None, Query(max_length=200, description="an actor's owner or token name")] = None,
    job_id: Annotated[str | None, Query(alias="jobId", max_length=100)] = None,
    action: Annotated[str | None, Query(max_length=100)] = None,
    since: Instant | None = None,
    until: Instant | None = None,
    cursor: Annotated[str | None, Query(max_length=100)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> JSONResponse:
    """Audit entries, newest first. An admin reads every entry; an owner's token only those about its
    own jobs and calendars."""
    refuse_unstorable(actor=actor, action=action)
    job = parse_id(job_id, "job") if job_id else None
    where = AuditFilter(subject_owner=caller.owner_filter, actor=actor, job_id=job, action=action,
                        since=since, until=until)
    after = _decode_cursor(cursor)
    pools = await homes.pools_for(request, job)
    pages = await asyncio.gather(*(_page(pool, where, after, limit + 1) for pool in pools))
    entries = list(heapq.merge(*pages, key=_newest_first))[:limit + 1]
    page = entries[:limit]
    next_cursor = _encode_cursor(page[-1]) if len(entries) > limit else None
    return JSONResponse({"entries": [entry_view(e) for e in page], "nextCursor": next_cursor})


async def _page(pool: Any, where: AuditFilter, after: tuple[datetime, uuid.UUID] | None,
                limit: int) -> list[AuditEntry]:
    async with pool.acquire() as conn:
        return await list_entries(conn, where, after, limit)


def _newest_first(entry: AuditEntry) -> tuple[float, bytes]:
    return -entry.at.timestamp(), bytes(255 - b for b in entry.entry_id.bytes)


def entry_view(entry: AuditEntry) -> dict[str, Any]:
    return {
        "entryId": entry.entry_id, "at": entry.at, "action": entry.action, "subject": entry.subject,
        "jobId": entry.job_id, "owner": entry.subject_owner,
        "actor": {"owner": entry.actor_owner, "tokenId": entry.actor_token, "tokenName": entry.actor_name},
        "requestId": entry.request_id, "changes": entry.changes,
    }


def _encode_cursor(entry: AuditEntry) -> str:
    micros = ((entry.at - _EPOCH) // timedelta(microseconds=1)).to_bytes(8, "big", signed=True)
    return base64.urlsafe_b64encode(micros + entry.entry_id.bytes).decode().rstrip("=")


def _decode_cursor(cursor: str | None) -> tuple[datetime, uuid.UUID] | None:
    if not cursor:
        return None
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        if len(raw) != 24:
            raise ValueError
        at = _EPOCH + timedelta(microseconds=int.from_bytes(raw[:8], "big", signed=True))
        return at, uuid.UUID(bytes=raw[8:])
    except (ValueError, OverflowError, OSError):
        raise ApiError(400, "invalid_request", "cursor is not one this API returned", "cursor") from None



