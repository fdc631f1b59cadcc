"""``GET /healthz``: 200 while the API reaches its primary; otherwise 503 with what is wrong.

What is wrong is said without naming hosts (the endpoint needs no token): since when the database
has been unavailable to this process, how many steps failed meanwhile, and, for a URL with several
hosts, what each host is now: the primary, a standby (read-only: a failover is under way or no
host was promoted), refusing connections, or not answering at all (a host or a zone lost).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from datetime import UTC, datetime
from typing import Any

from chimes import outage
from chimes.store import db

PROBE_TIMEOUT_SEC = 2.0
PROBE_CACHE_SEC = 2.0  # probes are cheap but not free: a load balancer may ask every second

_probed: tuple[float, list[str]] | None = None


async def check(pool: Any, dsn: str) -> tuple[int, dict[str, Any]]:
    """(status code, body) for /healthz."""
    try:
        await db.ping(pool)
    except Exception as exc:  # any failure to reach the database is "unavailable"
        outage.failed("GET /healthz", db.describe(exc))
        return 503, await _unavailable(dsn, db.describe(exc))
    return 200, {"status": "ok"}


async def _unavailable(dsn: str, error: str) -> dict[str, Any]:
    body: dict[str, Any] = {"status": "unavailable", "error": error}
    going_on = outage.current()
    if going_on is not None:
        body["since"] = datetime.fromtimestamp(going_on.since, UTC).isoformat().replace("+00:00", "Z")
        body["failedSteps"] = going_on.failures
    hosts = db.split_hosts(dsn)
    if len(hosts) > 1:
        states = await _host_states(hosts)
        body["hosts"] = dict(Counter(states))
        if "primary" not in states:
            body["error"] = f"no primary among the {len(hosts)} hosts of the database URL ({_list(states)}); {error}"
    return body


async def _host_states(hosts: list[str]) -> list[str]:
    global _probed
    now = time.monotonic()
    if _probed is None or now - _probed[0] > PROBE_CACHE_SEC:
        _probed = (now, list(await asyncio.gather(*(db.server_role(host, PROBE_TIMEOUT_SEC) for host in hosts))))
    return _probed[1]


def _list(states: list[str]) -> str:
    return ", ".join(f"{n} {state}" for state, n in Counter(states).items())
