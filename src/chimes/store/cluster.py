"""What Chimes does to a Patroni cluster's database server directly (chimes.ha.cluster): create its own
database, which Patroni does not, and wait until every standby has it too; and, at a clean stop of a
cluster that archives its WAL, archive the segment in use."""

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
            await conn.execute(sql("create_database", database=_quoted(database)))
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


async def archive_current_wal(host: str, port: int, password: str, timeout_sec: float) -> str:
    """Close the current WAL segment of the primary at ``host``:``port`` and wait until the archiver
    has taken it; returns its name. A RuntimeError says why not (with the archiver's last failure)."""
    try:
        conn = await asyncpg.connect(host=host, port=port, user="postgres", password=password, database="postgres",
                                     timeout=10)
    except asyncpg.PostgresError as exc:
        raise RuntimeError(f"could not connect to {host}:{port}: {exc}") from None
    try:
        segment: str = await conn.fetchval(sql("switch_wal"))
        deadline = time.monotonic() + timeout_sec
        while True:
            archived, failed = await conn.fetchrow(sql("archiver_state")) or (None, None)
            if archived is not None and archived >= segment:
                return segment
            if time.monotonic() > deadline:
                raise RuntimeError(f"{segment} was not archived within {timeout_sec:g} s (the archiver's last "
                                   f"failure: {failed or 'none'})")
            await asyncio.sleep(0.1)
    except asyncpg.PostgresError as exc:
        raise RuntimeError(f"could not archive the current WAL segment: {exc}") from None
    finally:
        await conn.close()
