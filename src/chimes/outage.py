"""One log line when a process loses a database, one when it has it back: not one per failed call.

During a failover every loop of every role fails, each several times a second, and so does the pool
restoring its connections; a log with a line for each hides the two facts that matter, when the
primary was lost and when the process had one again. The first transient failure after a healthy
spell is logged as a warning with its cause; the ones after it are counted (and logged at debug
level) until a connection to that database is made again, which is logged with how long the outage
lasted and how many steps failed meanwhile. An outage that goes on is summed up every
``REMIND_SEC`` seconds, so a long one is never silent. /healthz reads :func:`current` to say since
when the database has been unavailable and why.

Every line names the database and what it is to this process (the catalog, a shard, a move's source
or target) and where it is: a process with shards has several, and one of them down is a different
outage from another. The store names a failure as it happens (:func:`blame`, chimes.store.db), on
the connection or the connect that met it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("chimes.database")

REMIND_SEC = 30.0
# A failure this long after the last one starts a new outage: the steps between succeeded.
QUIET_SEC = 30.0


@dataclass(frozen=True, slots=True)
class Database:
    """A database as outages are told: ``role`` is what it is to this process ("catalog", "shard 2",
    None when not said), ``label`` names it in log lines with where it is ("catalog (db1:5432/chimes)"),
    never with a password."""

    role: str | None
    label: str

    @property
    def key(self) -> str:
        """What its outages are counted by: its role (a failover moves it between hosts), else its label."""
        return self.role or self.label


UNKNOWN = Database(None, "a database (which one was not recorded)")
_BLAMED = "_chimes_database"  # the attribute a failure carries its database in


def blame(exc: BaseException, database: Database) -> None:
    """Record on ``exc`` which database it came from (the first to record it wins: the nearest)."""
    if getattr(exc, _BLAMED, None) is None:
        setattr(exc, _BLAMED, database)


def database_of(exc: BaseException) -> Database:
    """The database a failure came from: its own record, or that of an error it was raised from."""
    seen: BaseException | None = exc
    for _ in range(10):  # a chain is short; a cycle is not followed for ever
        if seen is None:
            break
        found = getattr(seen, _BLAMED, None)
        if isinstance(found, Database):
            return found
        seen = seen.__cause__ or seen.__context__
    return UNKNOWN


@dataclass(slots=True)
class Outage:
    database: Database
    since: float  # epoch seconds of the first failure
    cause: str  # the first failure, described
    last_cause: str
    failures: int = 1
    last_failure: float = 0.0  # monotonic
    reminded: float = 0.0  # monotonic


_current: dict[str, Outage] = {}


def current() -> Outage | None:
    """The oldest outage going on in this process, if any (each ends when its database is reached)."""
    return min(_current.values(), key=lambda o: o.since, default=None)


def going_on() -> list[Outage]:
    """Every outage going on in this process, one per database."""
    return list(_current.values())


def failed(what: str, cause: str, database: Database = UNKNOWN) -> None:
    """A step (``what``) could not reach ``database`` (or its primary) because of ``cause``."""
    now = time.monotonic()
    going_on = _current.get(database.key)
    if going_on is not None and now - going_on.last_failure > QUIET_SEC:
        going_on = None  # steps have been succeeding meanwhile: this is a new outage
    if going_on is None:
        _current[database.key] = Outage(database, time.time(), cause, cause, last_failure=now, reminded=now)
        log.warning("database unavailable: %s: %s failed: %s (until it is back, further failures are counted, "
                    "not logged)", database.label, what, cause)
        return
    going_on.failures += 1
    going_on.last_failure = now
    going_on.last_cause = cause
    log.debug("%s: %s failed: %s", database.label, what, cause)
    if now - going_on.reminded >= REMIND_SEC:
        going_on.reminded = now
        log.warning("database still unavailable: %s, after %.0f s (%d failed steps); last: %s", database.label,
                    time.time() - going_on.since, going_on.failures, cause)


def connected(database: Database) -> None:
    """A connection to ``database`` was made: an outage of it going on is over."""
    outage = _current.pop(database.key, None)
    if outage is None:
        return
    log.warning("database back: connected to %s after %.1f s unavailable (%d failed steps)", database.label,
                time.time() - outage.since, outage.failures)
