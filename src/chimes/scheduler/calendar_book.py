"""The exclusion calendars a scheduler node fires by, held in memory: planning a fire reads no
database (chimes.scheduler.firing is pure). Every ``CALENDAR_REFRESH_SEC`` the node reads the sum of
the calendars' changes and their count from the catalog (one index read) and, when either changed,
reads again the calendars whose change it does not hold, so an edit reaches every node within that
time.

Each calendar is parsed on its own: one that cannot be read is logged and held as unusable (it
excludes every slot of the jobs naming it), and every other owner's calendars load as ever.

A node fires no slot of a job that names calendars before the book can answer for them
(:meth:`CalendarBook.knows`): before its first read, and for a name it holds no calendar by until a
read begun after that name was first asked for (a calendar made just before the job naming it may
not have been read yet). Such a trigger stays in the database and fires at a later scan, late
rather than by a guess."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from chimes.calendars import Calendar
from chimes.store.calendars import CalendarKey, calendar_changes, calendar_fingerprint, calendars_by_key
from chimes.store.db import Pool

CALENDAR_REFRESH_SEC = 2.0
log = logging.getLogger(__name__)


class CalendarBook:
    def __init__(self, catalog: Pool) -> None:
        self._catalog = catalog
        self._fingerprint: tuple[Any, int] | None = None
        self._changes: dict[CalendarKey, int] = {}  # the change each held calendar was read at
        self.calendars: Mapping[CalendarKey, Calendar] = {}  # (owner, name) -> calendar
        self._reads_begun = 0
        self._read = 0  # the number of the last read that ended (0: none yet): the book is as of its start
        self._asked: dict[CalendarKey, int] = {}  # names not held, and the reads begun when first asked for

    @property
    def loaded(self) -> bool:
        return self._read > 0

    async def refresh(self) -> bool:
        """Read the calendars that changed since the last read; whether any had."""
        self._reads_begun += 1
        began = self._reads_begun
        fingerprint = await calendar_fingerprint(self._catalog)
        changed = fingerprint != self._fingerprint
        if changed:
            await self._reload()
            self._fingerprint = fingerprint
        self._read = began
        for key in [key for key in self._asked if key in self.calendars]:
            del self._asked[key]
        return changed

    async def _reload(self) -> None:
        changes = await calendar_changes(self._catalog)
        stale = [key for key, change in changes.items() if self._changes.get(key) != change]
        fresh = await calendars_by_key(self._catalog, stale)
        held = {key: calendar for key, calendar in self.calendars.items() if key in changes and key not in stale}
        kept = {key: change for key, change in self._changes.items() if key in held}
        for key, (change, calendar) in fresh.items():
            held[key], kept[key] = calendar, change
            if calendar.problem is not None:
                log.error("calendar %s of %s %s: every slot of the jobs naming it is skipped until it is "
                          "written again", key[1], key[0], calendar.problem)
        self.calendars, self._changes = held, kept
        log.info("calendars: %d, %d read again", len(held), len(fresh))

    def knows(self, owner: str, names: Sequence[str]) -> bool:
        """Whether the book can answer for the owner's calendars by these names: it has read the
        catalog, and each name it holds no calendar by was missing from a read begun after that
        name was first asked for."""
        if not self.loaded:
            return False
        known = True
        for name in names:
            key = (owner, name)
            if key not in self.calendars and self._asked.setdefault(key, self._reads_begun) >= self._read:
                known = False
        return known
