"""A client of the API during a failover: one-off jobs created one at a time, every answer recorded.

Shared by the failover tests (tests/e2e/test_high_availability.py, test_zone_failover.py): the
client (bench/api_client.py, which the HA benchmarks use too) keeps writing through the outage, and
the test reads from what it recorded when writes were accepted again, what every answer was and
which jobs were acknowledged.
"""

from __future__ import annotations

from pathlib import Path

import asyncpg
from cryptography.fernet import Fernet

from bench.api_client import REQUEST_TIMEOUT
from bench.api_client import Writer as ApiWriter
from chimes.store.tokens import create_token
from tests.e2e.processes import ChimesProcess, Processes
from tests.helpers import free_port, wait_for


class Writer(ApiWriter):
    """The shared writer (bench/api_client.py), one write at a time every 0.3 s, and what a test checks
    of its answers."""

    def check_answers(self) -> None:
        """Only 201, or 503 while no primary was reachable; never a hang past the API's timeout."""
        print(f"writes: {len(self.writes)}, answers {sorted({w.status for w in self.writes}, key=str)}", flush=True)
        assert {w.status for w in self.writes} <= {201, 503}, [w for w in self.writes if w.status not in (201, 503)]
        assert max(w.ended - w.started for w in self.writes) < REQUEST_TIMEOUT + 3


async def all_acknowledged_ran_once(dsn: str, acknowledged: list[str]) -> list[asyncpg.Record]:
    """Waits until every acknowledged job's run succeeded; returns the slots with more than one run."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        async def all_ran() -> bool:
            done = await conn.fetchval("SELECT count(DISTINCT job_id) FROM runs "
                                       "WHERE job_id = ANY($1::uuid[]) AND status = 'succeeded'", acknowledged)
            return done == len(acknowledged)

        await wait_for(all_ran, timeout=60, what=f"all {len(acknowledged)} acknowledged jobs to run")
        return await conn.fetch("SELECT job_id, scheduled_at FROM runs GROUP BY 1, 2 HAVING count(*) > 1")
    finally:
        await conn.close()


def processes_for(dsn: str, tmp_path: Path) -> Processes:
    procs = Processes(dsn, tmp_path)
    procs.env.update({"CHIMES_SECRET_KEY": Fernet.generate_key().decode(), "CHIMES_DATA_DIR": str(tmp_path / "d")})
    return procs


async def migrated_with_api(procs: Processes, dsn: str) -> tuple[str, str, ChimesProcess]:
    """Migrate the database, make a team's token, start the API on 127.0.0.1: (token, its URL, the API)."""
    migrate = procs.start("migrate", "migrate")
    assert await migrate.exited(60) == 0, migrate.output()
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        token = await create_token(conn, "team", admin=False)
    finally:
        await conn.close()
    port = free_port()
    api = procs.start("api", "api", "--host", "127.0.0.1", "--port", str(port))
    return token, f"http://127.0.0.1:{port}", api
