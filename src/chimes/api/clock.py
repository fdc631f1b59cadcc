"""The clock a request reads: the one ``create_app`` was given, kept on ``app.state.clock``.

Endpoints and dashboard pages read "now" through ``clock_of(request)``, never the host's clock
directly, so that a test can serve the API on a clock that is off (tests/integration/test_api_clock.py).
What the API decides alone reads this clock: a new job's first fire time (``nextRunAt``), whether a
backfill's end is still in the past, the time stamped on a manual run or a reported callback, queue lag
and the "ago" on a page. Whether a lease or a trigger's time has passed stays with the database's
``now()`` (chimes.clock says why).
"""

from __future__ import annotations

from starlette.requests import HTTPConnection

from chimes.clock import Clock

__all__ = ["clock_of"]


def clock_of(request: HTTPConnection) -> Clock:
    """The clock of the app serving this request."""
    clock: Clock = request.app.state.clock
    return clock
