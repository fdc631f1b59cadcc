"""Times as Chimes takes them from outside: RFC 3339 with an offset, kept in UTC.

Python's datetime holds years 1 to 9999 in the time's own offset, so ``9999-12-31T23:59:59-23:59``
and ``0001-01-01T00:00:00+23:59`` parse, yet fall past the calendar's ends once in UTC, where every
comparison, statement and stored time takes them: OverflowError there was an answer of 500. Every
field that takes a time is an :data:`Instant` (or goes through :func:`in_utc`), which refuses such a
time where it is read, naming the field, and hands on the same instant in UTC.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from pydantic import AfterValidator, AwareDatetime

EARLIEST = datetime.min.replace(tzinfo=UTC)
LATEST = datetime.max.replace(tzinfo=UTC)


def in_utc(instant: datetime) -> datetime:
    """``instant`` (aware) in UTC; ValueError, saying which times are, when UTC cannot hold it."""
    try:
        return instant.astimezone(UTC)
    except OverflowError:
        raise ValueError(f"is not a time Chimes can hold: in UTC it must fall from {EARLIEST:%Y-%m-%dT%H:%M:%SZ} "
                         f"to {LATEST:%Y-%m-%dT%H:%M:%S.%fZ}") from None


#: A time with an offset, in UTC once validated: the type of every API field and parameter that takes one.
Instant = Annotated[AwareDatetime, AfterValidator(in_utc)]
