"""The notification outbox: what was sent to the teams' webhooks, what waits, and what was given up."""

from __future__ import annotations

import asyncio
import base64
import heapq
import uuid
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request

from chimes.api import homes
from chimes.api.auth import current_principal
from chimes.api.errors import ApiError
from chimes.api.jobs import parse_id
from chimes.api.responses import JSONResponse
from chimes.instants import in_utc
from chimes.store.notifications import NotificationStatus, NotificationStore
from chimes.store.tokens import Principal

router = APIRouter(tags=["notifications"])
Caller = Annotated[Principal, Depends(current_principal)]


@router.get("/notifications", response_class=JSONResponse)
async def list_notifications(
    request: Request, caller: Caller,
    status: NotificationStatus | None = None,
    job_id: Annotated[str | None, Query(alias="jobId", max_length=100)] = None,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> JSONResponse:
    """The caller's notifications (an admin's: everyone's), newest first; ``status=dead`` lists those
    given up on, with the last error their webhook gave."""
    job = parse_id(job_id, "job") if job_id else None
    after = _decode_cursor(cursor)
    # With shards, each home's first page after the cursor, merged newest first (docs/scaling.md).
    pages = await asyncio.gather(*(NotificationStore(pool).list(caller.owner_filter, status, job, after, limit + 1)
                                   for pool in await homes.pools_for(request, job)))
    rows = list(heapq.merge(*pages, key=_newest_first_key, reverse=True))[:limit + 1]
    page = rows[:limit]
    next_cursor = _encode_cursor(page[-1]) if len(rows) > limit else None
    return JSONResponse({"notifications": [notification_view(r) for r in page], "nextCursor": next_cursor})


def _newest_first_key(row: Any) -> tuple[datetime, uuid.UUID]:
    return row["created_at"], row["notification_id"]


def notification_view(row: Any) -> dict[str, Any]:
    return {
        "notificationId": row["notification_id"], "jobId": row["job_id"], "owner": row["owner"],
        "kind": row["kind"], "status": row["status"], "url": row["url"], "createdAt": row["created_at"],
        "attempts": row["attempts"], "nextAttemptAt": row["next_attempt_at"] if row["status"] == "pending" else None,
        "sentAt": row["sent_at"], "deadAt": row["dead_at"], "lastError": row["last_error"],
        "payload": row["payload"],
    }


def _encode_cursor(row: Any) -> str:
    text = f"{row['created_at'].isoformat()}|{row['notification_id']}"
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _decode_cursor(cursor: str | None) -> tuple[datetime, uuid.UUID] | None:
    if not cursor:
        return None
    try:
        at, _, notification_id = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode().partition("|")
        created_at = datetime.fromisoformat(at)
        if created_at.tzinfo is None:
            raise ValueError("no offset")
        return in_utc(created_at), uuid.UUID(notification_id)  # a forged offset can take it past year 9999
    except ValueError:
        raise ApiError(400, "invalid_request", "cursor is not one this API returned", "cursor") from None
