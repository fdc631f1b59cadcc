"""What wrote the WAL between two positions, by relation and kind of record (``pg_walinspect``).

Every byte of WAL goes to each standby and to the archive, and a primary's WAL rate is one of the
limits on how far it goes (docs/scaling.md). The breakdown shows which rows and index entries a run
writes, and which of them were written more than once. ``pg_walinspect`` is a contrib extension: the
embedded server has it; elsewhere it needs installing and a superuser, and the breakdown is left out.
"""

from __future__ import annotations

from typing import Any

import asyncpg

BY_RECORD = """
SELECT coalesce(c.relname, b.relfilenode::text) AS relation, b.record_type,
       count(DISTINCT b.start_lsn) AS records,
       sum(b.record_length) FILTER (WHERE b.block_id = 0) AS bytes  -- once per record, not per block
FROM pg_get_wal_block_info($1::pg_lsn, $2::pg_lsn) b
LEFT JOIN pg_class c ON c.relfilenode = b.relfilenode
GROUP BY 1, 2 ORDER BY 4 DESC NULLS LAST LIMIT $3
"""


async def can_inspect(pool: asyncpg.Pool) -> bool:
    try:
        await pool.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
    except asyncpg.PostgresError:
        return False
    return True


async def by_record(pool: asyncpg.Pool, start: str, end: str, per: float, top: int = 12) -> list[dict[str, Any]]:
    """The heaviest (relation, record type) pairs between ``start`` and ``end``, per ``per`` (a second,
    a run). A record touching several blocks counts for the relation of its first block."""
    rows = await pool.fetch(BY_RECORD, start, end, top)
    return [{"relation": r["relation"], "record": r["record_type"], "records": round(r["records"] / per, 2),
             "bytes": round(float(r["bytes"] or 0) / per, 1)} for r in rows]


def describe(breakdown: list[dict[str, Any]], per: str) -> list[str]:
    return [f"relation | record | records/{per} | bytes/{per}"] + [
        f"{r['relation']} | {r['record']} | {r['records']:,} | {r['bytes']:,}" for r in breakdown]
