"""The one thing Chimes does to a Patroni cluster's database server directly: create its own database,
which Patroni does not, and wait until every standby has it too (chimes.ha.cluster)."""

from __future__ import annotations

import asyncio
import time

import asyncpg

from chimes.store.queries import sql


async def create_replicated_database(host: str, port: int, password: str, database: str,
                                     replay_wait_sec: float = 60.0) -> None:
    """Create ``database`` on the primary at ``host``:``port`` (as ``postgres``) unless it exists, then
    wait for the standbys to replay it: a synchronous commit waits for a standby to have the WAL, not
    to have replayed it, and a client that reached a standby first would be told the database does not
    exist (asyncpg does not try the next host after an error of the server)."""
    conn = await asyncpg.connect(host=host, port=port, user="postgres", password=password, database="postgres")
    try:
        if not await conn.fetchval(sql("database_exists"), database):
            await conn.execute(sql("create_database").format(database=_quoted(database)))
        lsn = await conn.fetchval(sql("current_wal_lsn"))
        deadline = time.monotonic() + replay_wait_sec
        while await conn.fetchval(sql("standbys_behind"), lsn):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the standbys did not replay the new database within {replay_wait_sec:g} s")
            await asyncio.sleep(0.1)
    finally:
        await conn.close()


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'
