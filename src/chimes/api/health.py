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

from chimes import __version__, outage
from chimes.store import db
from chimes.store.shards import ShardPools

PROBE_TIMEOUT_SEC = 2.0
PROBE_CACHE_SEC = 2.0  # probes are cheap but not free: a load balancer may ask every second

_probed: tuple[float, list[str]] | None = None


async def check(pool: Any, dsn: str) -> tuple[int, dict[str, Any]]:
    """(status code, body) for /healthz; either names the release this process runs."""
    try:
        await db.ping(pool)
    except Exception as exc:  # any failure to reach the database is "unavailable"
        outage.failed("GET /healthz", db.describe(exc), outage.database_of(exc))
        return 503, {**await _unavailable(dsn, db.describe(exc)), "version": __version__}
    return 200, {"status": "ok", "version": __version__}


async def shard_states(shards: ShardPools) -> dict[str, str]:
    """With shards: each shard's state by its id ("ok", or "unavailable" and the error's type). A shard that is
    down leaves /healthz at 200: the API still serves every other home's jobs, and a load balancer
    that took every API out for one shard would stop them all."""
    ranges = {r.shard_id: r.first for r in shards.map.ranges}

    async def state(first: int) -> str:
        try:
            await asyncio.wait_for(db.ping(await shards.for_partition(first)), PROBE_TIMEOUT_SEC)
        except Exception as exc:  # its type only: the endpoint needs no token, and messages name hosts
            return f"unavailable ({type(exc).__name__})"
        return "ok"

    found = await asyncio.gather(*(state(first) for first in ranges.values()))
    return {str(shard_id): answer for shard_id, answer in zip(ranges, found, strict=True)}


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
