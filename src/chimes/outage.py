"""One log line when a process loses its database, one when it has it back: not one per failed call.

During a failover every loop of every role fails, each several times a second, and so does the pool
restoring its connections; a log with a line for each hides the two facts that matter, when the
primary was lost and when the process had one again. The first transient failure after a healthy
spell is logged as a warning with its cause; the ones after it are counted (and logged at debug
level) until a connection to a primary is made again, which is logged with how long the outage
lasted and how many steps failed meanwhile. An outage that goes on is summed up every
``REMIND_SEC`` seconds, so a long one is never silent. /healthz reads :func:`current` to say since
when the database has been unavailable and why.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("chimes.database")

REMIND_SEC = 30.0
# A failure this long after the last one starts a new outage: the steps between succeeded.
QUIET_SEC = 30.0


@dataclass(slots=True)
class Outage:
    since: float  # epoch seconds of the first failure
    cause: str  # the first failure, described
    last_cause: str
    failures: int = 1
    last_failure: float = 0.0  # monotonic
    reminded: float = 0.0  # monotonic


_current: Outage | None = None


def current() -> Outage | None:
    """The outage going on in this process, if any (reset when a connection is made again)."""
    return _current


def failed(what: str, cause: str) -> None:
    """A step (``what``) could not reach the database (or its primary) because of ``cause``."""
    global _current
    now = time.monotonic()
    if _current is not None and now - _current.last_failure > QUIET_SEC:
        _current = None  # steps have been succeeding meanwhile: this is a new outage
    if _current is None:
        _current = Outage(time.time(), cause, cause, last_failure=now, reminded=now)
        log.warning("database unavailable: %s failed: %s (until it is back, further failures are counted, not "
                    "logged)", what, cause)
        return
    _current.failures += 1
    _current.last_failure = now
    _current.last_cause = cause
    log.debug("%s failed: %s", what, cause)
    if now - _current.reminded >= REMIND_SEC:
        _current.reminded = now
        log.warning("database still unavailable after %.0f s (%d failed steps); last: %s",
                    time.time() - _current.since, _current.failures, cause)


def connected(server: str) -> None:
    """A connection to ``server`` was made: an outage going on is over."""
    global _current
    if _current is None:
        return
    outage, _current = _current, None
    log.warning("database back: connected to %s after %.1f s unavailable (%d failed steps)", server,
                time.time() - outage.since, outage.failures)
