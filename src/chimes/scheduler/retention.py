"""Retention: run history older than the retention period goes, a whole day's partition at a time,
and so do the notifications that were delivered or dead-lettered before it, and the audit trail's
entries older than it (the trail is kept as long as the history it explains).

Dropping a partition needs an ACCESS EXCLUSIVE lock on ``runs``/``run_attempts``. Behind a long
reader (a report, a ``pg_dump``) that lock request would wait, and every reader after it would queue
behind the request: the API would stall for as long as the long reader ran. So each day is dropped
in its own short transaction that waits at most ``lock_timeout_sec`` for its locks; a day that could
not get them is left for the next round (hourly), and the rounds after it, until it goes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from chimes.store.db import LockNotAvailable, Pool
from chimes.store.retention import RetentionStore

log = logging.getLogger(__name__)

LOCK_TIMEOUT_SEC = 1.0  # the longest a reader of run history may be held up by a drop
NOTIFICATION_BATCH = 10_000


@dataclass(slots=True)
class RetentionResult:
    dropped: int = 0  # partitions dropped
    deferred: list[str] = field(default_factory=list)  # partitions left for later: a reader held them
    rows_deleted: int = 0  # run-history rows of the default partitions
    notifications_deleted: int = 0
    audit_entries_deleted: int = 0


class Retention:
    def __init__(self, pool: Pool, days: int, lock_timeout_sec: float = LOCK_TIMEOUT_SEC,
                 notification_batch: int = NOTIFICATION_BATCH) -> None:
        self.store = RetentionStore(pool)
        self.days = days
        self.lock_timeout_sec = lock_timeout_sec
        self.notification_batch = notification_batch

    async def sweep(self, now: datetime) -> RetentionResult:
        """One round; never waits on a lock longer than ``lock_timeout_sec`` at a time."""
        cutoff = (now - timedelta(days=self.days)).replace(hour=0, minute=0, second=0, microsecond=0)
        result = RetentionResult()
        for day in await self.store.old_days(cutoff.date()):
            try:
                await self.store.drop_day(day, self.lock_timeout_sec)
            except LockNotAvailable:
                result.deferred += day.tables
                continue
            result.dropped += len(day.tables)
        try:
            result.rows_deleted = await self.store.delete_old_default_rows(cutoff, self.lock_timeout_sec)
        except LockNotAvailable:
            pass  # next round
        while True:
            deleted = await self.store.delete_old_notifications(cutoff, self.notification_batch)
            result.notifications_deleted += deleted
            if deleted < self.notification_batch:
                break
        while True:
            deleted = await self.store.delete_old_audit_entries(cutoff, self.notification_batch)
            result.audit_entries_deleted += deleted
            if deleted < self.notification_batch:
                break
        if result.deferred:
            log.warning("retention: %s busy (a long reader holds them); tried again next round",
                        ", ".join(result.deferred))
        if result.dropped or result.notifications_deleted or result.audit_entries_deleted:
            log.info("retention: dropped %d run-history partitions, %d notifications and %d audit entries older "
                     "than %d days", result.dropped, result.notifications_deleted, result.audit_entries_deleted,
                     self.days)
        return result

