"""The notification outbox as the API and the dashboard read it: pending, sent and dead-lettered."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Literal

import asyncpg

from chimes.store.queries import sql

NotificationStatus = Literal["pending", "sent", "dead"]


class NotificationStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def list(self, owner: str | None, status: NotificationStatus | None, job_id: uuid.UUID | None,
                   before: tuple[datetime, uuid.UUID] | None, limit: int) -> list[asyncpg.Record]:
        """Newest first; ``owner`` None lists every owner's (admins)."""
        at, notification_id = before if before else (None, None)
        return await self._pool.fetch(sql("list_notifications"), limit, owner, status, at, notification_id, job_id)
