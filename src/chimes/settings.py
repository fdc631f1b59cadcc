"""Settings shared by every role, read once at start-up and frozen afterwards, and the defaults of
every role's options.

Each default is declared here and nowhere else: the CLI options show it, the role's config
dataclasses, the API's job spec and the worker fall back to it. Where SQL must hold the same number
as a literal (a migration's function), ``tests/unit/test_settings_defaults.py`` ties the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import platformdirs

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
#: Seconds the API keeps an idle client connection open: longer than a load balancer's idle timeout
#: (60 s on most) and a client's (httpx: 5 s), so that the other side closes first. A server that
#: closes first races the next request sent on the connection, which then fails with no answer.
API_KEEP_ALIVE_SEC = 75

# --- jobs --------------------------------------------------------------------------------------
#: Seconds an attempt may run when its job names no ``timeoutSec``. The claim function of
#: migration 0002 falls back to the same number when it sets a run's deadline.
RUN_TIMEOUT_SEC = 3600
#: How far back a missed slot is still made up, when a job's catch-up policy names no ``windowSec``.
CATCH_UP_WINDOW_SEC = 86400

# --- scheduler node (chimes scheduler) ---------------------------------------------------------
#: Seconds a partition lease lasts unrenewed: how soon a dead node's partitions move (--lease-ttl).
PARTITION_LEASE_TTL_SEC = 5.0
#: Days of run history kept; older days are dropped a partition at a time (--retention-days).
RETENTION_DAYS = 30
#: Seconds late after which a slot counts as missed and follows its job's catch-up policy (--missed-after).
MISSED_AFTER_SEC = 60.0
# A scheduler node fires an instant of many triggers up to this long before it, committed at it
# (chimes.scheduler.node.SchedulerConfig.fire_ahead_sec; 0: every instant fires at its time).
FIRE_AHEAD_SEC = 1.0
#: Hours after which a notification its webhook never accepted is dead-lettered (--notify-give-up-hours).
NOTIFY_GIVE_UP_HOURS = 24.0

# --- worker (chimes worker, and the one chimes up starts) --------------------------------------
#: Runs a worker executes at once (--concurrency, --worker-concurrency). One owner may hold
#: owner_share of them, claimed a quarter of that at a time in a burst: enough slots that a burst's
#: start is bound by the claims, not by runs waiting for a slot (docs/benchmarks.md).
WORKER_CONCURRENCY = 200
#: Seconds a run's lease lasts unrenewed: how soon a dead worker's runs are retried (--lease-sec).
RUN_LEASE_SEC = 30.0
#: On SIGTERM, seconds in-flight runs get to finish before they are handed back (--shutdown-grace).
SHUTDOWN_GRACE_SEC = 30.0
#: The command that runs container tasks (--container-runtime).
CONTAINER_RUNTIME = "docker"
#: Seconds a command's or container's process group gets between SIGTERM and SIGKILL.
KILL_GRACE_SEC = 5.0
#: Seconds a role keeps trying a database that is starting, recovering or failing over (--database-wait).
DATABASE_WAIT_SEC = 60.0
#: Seconds to connect to one host of the database URL, TLS and authentication included
#: (--database-connect-timeout).
DATABASE_CONNECT_TIMEOUT_SEC = 5.0


def default_data_dir() -> Path:
    return Path(platformdirs.user_data_dir("chimes"))


@dataclass(frozen=True, slots=True)
class Settings:
    """Where the database is and where the API listens.

    ``database_url`` of ``None`` means the embedded PostgreSQL in ``data_dir``.
    """

    database_url: str | None = None
    data_dir: Path = Path()
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
