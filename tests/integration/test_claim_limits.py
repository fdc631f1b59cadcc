"""A statement that takes at most N rows takes at most N whatever plan PostgreSQL chooses.

``UPDATE/DELETE ... WHERE key IN (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED)`` can take more than n
rows: the planner may make the limited subquery the inner side of a nested-loop semi join, run it
again for every row of the outer scan, and with SKIP LOCKED each run passes over the rows taken
already and locks new ones. It does so with the statistics a queue has after ANALYZE found it
drained (no rows, some pages), which a busy fleet's autovacuum gives it often: the worker's claim
then took the whole queue. Each test sets those statistics, shows that the old shape of the
statement is trapped by them (the control), and counts what the statement itself takes.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from chimes.store import audit
from chimes.store.notifications import Outbox
from chimes.store.queries import sql
from chimes.store.retention import RetentionStore
from chimes.store.scheduling import SchedulerStore
from chimes.store.working import WorkerStore, by_key_settings
from tests.integration.test_fencing import fire_due_one_offs

pytestmark = pytest.mark.single_database("sets one database's planner statistics")

LIMIT = 100


async def analysed_while_drained(conn: asyncpg.Connection, table: str) -> None:
    """The statistics ANALYZE leaves on ``table`` when it runs while the table is empty but for its
    pages (a queue a moment after the workers drained it): zero rows on as many pages as it has
    now. The planner then estimates one row, however many there are."""
    pages = await conn.fetchval("SELECT pg_relation_size($1::regclass) / current_setting('block_size')::int", table)
    assert pages > 0, f"{table} has no pages: fill it first"
    await conn.execute("SELECT pg_restore_relation_stats('schemaname', 'public', 'relname', $1::text, "
                       "'relpages', $2::integer, 'reltuples', 0::real)", table, pages)


@contextlib.asynccontextmanager
async def rolled_back(conn: asyncpg.Connection) -> AsyncIterator[None]:
    transaction = conn.transaction()
    await transaction.start()
    try:
        yield
    finally:
        await transaction.rollback()


async def changed_by_control(conn: asyncpg.Connection, statement: str, *args: object) -> int:
    """How many rows ``statement`` (the old shape, a control) changes, in a transaction rolled back;
    asserts that its plan is the nested-loop semi join that runs the limited subquery again and again."""
    async with rolled_back(conn):
        plan = "\n".join(r[0] for r in await conn.fetch(f"EXPLAIN (ANALYZE, COSTS off, TIMING off) {statement}",
                                                          *args))
    assert "Nested Loop Semi Join" in plan, plan
    loops = [int(n) for n in re.findall(r"Limit \(actual rows=[\d.]+ loops=(\d+)\)", plan)]
    assert loops and max(loops) > 1, f"the limited subquery ran once:\n{plan}"
    async with rolled_back(conn):
        changed: int = await conn.fetchval(
            f"WITH changed AS ({statement} RETURNING 1) SELECT count(*) FROM changed", *args)
    return changed


OLD_CLAIM = """
DELETE FROM run_queue q WHERE (q.tier, q.queue_id) IN (
    SELECT c.tier, c.queue_id FROM run_queue c ORDER BY c.tier, c.queue_id LIMIT $1 FOR UPDATE SKIP LOCKED)"""


async def test_a_claim_takes_no_more_than_its_limit_with_the_statistics_of_a_drained_queue(
    pool: asyncpg.Pool, database_url: str
) -> None:
    await fire_due_one_offs(pool, 3 * LIMIT)
    conn = await asyncpg.connect(database_url, server_settings=by_key_settings())  # a worker's claim connection
    try:
        await analysed_while_drained(conn, "run_queue")
        assert await changed_by_control(conn, OLD_CLAIM, LIMIT) > LIMIT
        claimed = await WorkerStore(pool, "worker-1").claim(LIMIT, lease_sec=30, deadline_grace_sec=30)
    finally:
        await conn.close()
    assert len(claimed) == LIMIT
    assert await pool.fetchval("SELECT count(*) FROM run_queue") == 2 * LIMIT
    assert await pool.fetchval("SELECT count(*) FROM runs WHERE status = 'running'") == LIMIT


OLD_NOTIFICATION_CLAIM = """
UPDATE notifications n SET attempts = n.attempts + 1 WHERE n.notification_id IN (
    SELECT notification_id FROM notifications WHERE sent_at IS NULL AND dead_at IS NULL AND next_attempt_at <= now()
    ORDER BY next_attempt_at LIMIT $1 FOR UPDATE SKIP LOCKED)"""


async def add_notifications(pool: asyncpg.Pool, count: int, created_at: datetime, sent: bool) -> None:
    await pool.execute(
        "INSERT INTO notifications (notification_id, job_id, owner, kind, url, payload, created_at, sent_at) "
        "SELECT gen_random_uuid(), gen_random_uuid(), 'team-a', 'run_failed', 'http://127.0.0.1:9/', '{}', "
        "$2::timestamptz, CASE WHEN $3 THEN $2::timestamptz END FROM generate_series(1, $1::int)",
        count, created_at, sent)


async def test_the_outbox_claims_no_more_than_its_limit_with_the_statistics_of_a_drained_outbox(
    pool: asyncpg.Pool
) -> None:
    await add_notifications(pool, 3 * LIMIT, datetime.now(UTC) - timedelta(minutes=1), sent=False)
    async with pool.acquire() as conn:
        await analysed_while_drained(conn, "notifications")
        assert await changed_by_control(conn, OLD_NOTIFICATION_CLAIM, LIMIT) > LIMIT
    claimed = await Outbox(pool).claim(LIMIT, lease_sec=30)
    assert len(claimed) == LIMIT
    assert await pool.fetchval("SELECT count(*) FROM notifications WHERE attempts > 0") == LIMIT


OLD_ACQUIRE = """
UPDATE partition_leases l SET owner = 'control', token = l.token + 1 WHERE l.partition_id IN (
    SELECT partition_id FROM partition_leases WHERE owner IS NULL OR expires_at < now()
    ORDER BY partition_id LIMIT $1 FOR UPDATE SKIP LOCKED)"""


async def test_a_node_takes_no_more_than_its_share_of_partitions_with_misleading_statistics(
    pool: asyncpg.Pool
) -> None:
    """With another node alive, a node's lease round takes half the partitions, not all of them."""
    other = SchedulerStore(pool, "node-b")
    assert (await other.sync_leases("host", 2, {}, ttl_sec=30, release_extra=False)).held  # alive, then gives them up
    await pool.execute("UPDATE partition_leases SET owner = NULL, expires_at = '-infinity'")
    async with pool.acquire() as conn:
        await analysed_while_drained(conn, "partition_leases")
        assert await changed_by_control(conn, OLD_ACQUIRE, 512) > 512
    taken = await SchedulerStore(pool, "node-a").sync_leases("host", 1, {}, ttl_sec=30)
    assert len(taken.held) == 512 == taken.share
    assert await pool.fetchval("SELECT count(*) FROM partition_leases WHERE owner = 'node-a'") == 512


async def buffers_read(conn: asyncpg.Connection, statement: str, *args: object) -> int:
    """The buffers ``statement`` reads, executed in a transaction rolled back."""
    async with rolled_back(conn):
        plan = "\n".join(r[0] for r in await conn.fetch(
            f"EXPLAIN (ANALYZE, COSTS off, TIMING off, BUFFERS) {statement}", *args))
    found = re.search(r"Buffers: shared hit=(\d+)(?: read=(\d+))?", plan)
    assert found is not None, plan
    return int(found.group(1)) + int(found.group(2) or 0)


async def test_retention_deletes_its_batch_reading_what_it_deletes_not_the_table_once_a_row(
    pool: asyncpg.Pool
) -> None:
    """Without SKIP LOCKED the re-run subquery finds the same rows, so the old shape kept its limit,
    but read the table once for each row it looked at; picked once, a round reads about what it deletes."""
    old = datetime.now(UTC) - timedelta(days=30)
    await add_notifications(pool, 20 * LIMIT, old, sent=True)
    await pool.execute(
        "INSERT INTO audit_log (entry_id, at, actor_owner, action, subject, changes) "
        "SELECT gen_random_uuid(), $2, 'admin', 'job.delete', 'job', '{}' FROM generate_series(1, $1::int)",
        20 * LIMIT, old)
    cutoff = datetime.now(UTC) - timedelta(days=7)
    async with pool.acquire() as conn:
        for table, statement in (("notifications", "delete_old_notifications"),
                                 ("audit_log", "delete_old_audit_entries")):
            await analysed_while_drained(conn, table)
            assert await buffers_read(conn, sql(statement), cutoff, LIMIT) < 10 * LIMIT, statement
        assert await RetentionStore(pool).delete_old_notifications(cutoff, LIMIT) == LIMIT
        assert await audit.delete_older_than(conn, cutoff, LIMIT) == LIMIT
    assert await pool.fetchval("SELECT count(*) FROM notifications") == 19 * LIMIT
    assert await pool.fetchval("SELECT count(*) FROM audit_log") == 19 * LIMIT
