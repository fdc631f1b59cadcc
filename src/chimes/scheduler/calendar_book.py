"""The exclusion calendars a scheduler node fires by, held in memory: planning a fire reads no
database (chimes.scheduler.firing is pure). Every ``CALENDAR_REFRESH_SEC`` the node reads the
calendars' newest version and count from the catalog (one index read) and reloads them all when
either changed, so an edit reaches every node within that time."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from chimes.calendars import Calendar
from chimes.store.calendars import all_calendars, calendar_fingerprint
from chimes.store.db import Pool

CALENDAR_REFRESH_SEC = 2.0
log = logging.getLogger(__name__)


class CalendarBook:
    def __init__(self, catalog: Pool) -> None:
        self._catalog = catalog
        self._fingerprint: tuple[int, int] | None = None
        self.calendars: Mapping[tuple[str, str], Calendar] = {}  # (owner, name) -> calendar

    async def refresh(self) -> bool:
        """Reload when the catalog's calendars changed; whether they had."""
        fingerprint = await calendar_fingerprint(self._catalog)
        if fingerprint == self._fingerprint:
            return False
        self.calendars = await all_calendars(self._catalog)
        self._fingerprint = fingerprint
        log.info("calendars: %d, version %d", len(self.calendars), fingerprint[0])
        return True
