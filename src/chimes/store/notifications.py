"""The notification outbox: claimed, marked and retried by the scheduler nodes that send it
(chimes.notifier), and read by the API and the dashboard: pending, sent and dead-lettered."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import asyncpg

from chimes.store.queries import sql

NotificationStatus = Literal["pending", "sent", "dead"]


@dataclass(frozen=True, slots=True)
class ClaimedNotification:
    notification_id: uuid.UUID
    owner: str
    url: str
    payload: Any
    attempts: int  # this one included


class Outbox:
    """The sending side: claim a batch with a lease, mark what was delivered, back off the rest."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def claim(self, limit: int, lease_sec: float) -> list[ClaimedNotification]:
        """Due notifications, each held for ``lease_sec``: not marked by then, it is claimed again."""
        rows = await self._pool.fetch(sql("claim_notifications"), limit, lease_sec)
        return [ClaimedNotification(*row) for row in rows]

    async def mark_sent(self, notification_ids: Sequence[uuid.UUID]) -> None:
        await self._pool.execute(sql("mark_notifications_sent"), notification_ids)

    async def retry(self, notification_ids: Sequence[uuid.UUID], delays_sec: Sequence[float], errors: Sequence[str],
                    give_up_after_sec: float) -> list[uuid.UUID]:
        """Back off each one by its delay, or dead-letter it when it was queued more than
        ``give_up_after_sec`` ago; returns the ids dead-lettered."""
        rows = await self._pool.fetch(sql("retry_notifications"), notification_ids, delays_sec, errors,
                                      give_up_after_sec)
        return [row["notification_id"] for row in rows if row["dead"]]


class NotificationStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def list(self, owner: str | None, status: NotificationStatus | None, job_id: uuid.UUID | None,
                   before: tuple[datetime, uuid.UUID] | None, limit: int) -> list[asyncpg.Record]:
        """Newest first; ``owner`` None lists every owner's (admins)."""
        at, notification_id = before if before else (None, None)
        return await self._pool.fetch(sql("list_notifications"), limit, owner, status, at, notification_id, job_id)
