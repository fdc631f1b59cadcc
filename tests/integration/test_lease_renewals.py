"""A lease round renews every partition a node holds, every second, idle or not: each renewal must
update its row in place (a HOT update: no new index entry, the smallest WAL record), which needs
room on the row's page for the new version (migration 0009). A renewal moved to another page is the
costly kind, and on full pages a quarter to a half of them were (python -m bench idle-wal)."""

from __future__ import annotations

import asyncpg
import pytest

from chimes.store.scheduling import SchedulerStore

pytestmark = pytest.mark.usefixtures("quiet_server")

PAGES = "SELECT partition_id, (ctid::text::point)[0]::int AS page FROM partition_leases"


async def test_renewing_every_partition_keeps_each_lease_on_its_page(pool: asyncpg.Pool) -> None:
    store = SchedulerStore(pool, "node-a")
    held = (await store.sync_leases("host", 1, {}, ttl_sec=30)).held
    assert len(held) == 1024
    before = {r["partition_id"]: r["page"] for r in await pool.fetch(PAGES)}
    for _ in range(5):
        assert (await store.sync_leases("host", 1, held, ttl_sec=30)).held == held
    after = {r["partition_id"]: r["page"] for r in await pool.fetch(PAGES)}
    moved = sorted(p for p in before if after[p] != before[p])
    assert not moved, f"{len(moved)} of 1,024 renewals left their page (not HOT), e.g. partition {moved[0]}"
