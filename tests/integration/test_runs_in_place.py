"""A run's claim and its outcome update the run in place (HOT, migration 0012): no index of `runs`
names a column those updates change, and the day partitions keep room on their pages for the new
versions, set by `chimes config set runs-fillfactor` (docs/operations.md)."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from chimes.scheduler.firing import plan_fires
from chimes.store.scheduling import SchedulerStore
from chimes.store.working import Completion, WorkerStore
from chimes.worker.tasks.common import Outcome
from tests.integration.test_fencing import due, make_due_job, take_all
from tests.integration.test_shards import config_command

pytestmark = pytest.mark.usefixtures("quiet_server")

# What the claim, the outcome, a retry, the reaper, a release or a cancel write into a run.
CHANGED_BY_UPDATES = ("status", "worker_id", "lease_token", "started_at", "finished_at", "error", "attempt",
                      "lease_losses", "output")
RUNS = 120  # several pages' worth, each page's runs claimed in one transaction and completed in another


async def page_of_each_run(pool: asyncpg.Pool) -> dict[uuid.UUID, int]:
    rows = await pool.fetch("SELECT run_id, (ctid::text::point)[0]::bigint AS page FROM runs")
    return {r["run_id"]: r["page"] for r in rows}


async def fired_claimed_and_done(pool: asyncpg.Pool, output: str | None = None
                                 ) -> tuple[dict[uuid.UUID, int], dict[uuid.UUID, int]]:
    """RUNS one-off runs fired together, claimed in one claim and completed in one batch, each with
    ``output``: the page of each run after the fire, and after the outcome."""
    for _ in range(RUNS):
        await make_due_job(pool, {"at": (datetime.now(UTC) - timedelta(seconds=1)).isoformat()})
    store = SchedulerStore(pool, "node")
    leases = await take_all(store)
    assert (await store.fire(leases, plan_fires(await due(store, leases)), datetime.now(UTC))).enqueued == RUNS
    fired = await page_of_each_run(pool)
    worker = WorkerStore(pool, "worker-1")
    claimed = await worker.claim(RUNS, lease_sec=30, deadline_grace_sec=30)
    assert len(claimed) == RUNS
    done = [Completion(run, Outcome.success(output), datetime.now(UTC), None) for run in claimed]
    assert await worker.complete(done) == {run.run_id for run in claimed}
    assert await pool.fetchval("SELECT count(*) FROM runs WHERE status = 'succeeded'") == RUNS
    return fired, await page_of_each_run(pool)


async def test_no_index_of_runs_names_a_column_its_updates_change(pool: asyncpg.Pool) -> None:
    """In a key, an expression or a predicate, any such column makes every update of a run a copy
    elsewhere with a new entry in every index of the table."""
    definitions = await pool.fetch(
        "SELECT indexrelid::regclass::text AS name, pg_get_indexdef(indexrelid) AS definition"
        " FROM pg_index WHERE indrelid = 'runs'::regclass")
    assert {d["name"] for d in definitions} == {"runs_pkey", "runs_job_history"}
    for d in definitions:
        named = [c for c in CHANGED_BY_UPDATES if re.search(rf"\b{c}\b", d["definition"])]
        assert named == [], f"{d['name']} names {named}: {d['definition']}"


async def test_a_claim_and_an_outcome_leave_each_run_on_its_page(pool: asyncpg.Pool) -> None:
    """No indexed column changes (above), so a run that stays on its page was updated in place; the
    outcome carries the longest output kept on the run (16 bytes, migration 0013)."""
    fired, done = await fired_claimed_and_done(pool, "x" * 16)
    assert await pool.fetchval("SELECT count(*) FROM run_attempts") == 0
    assert done == fired
    assert await pool.fetchval("SELECT count(*) FROM run_leases") == 0


async def test_without_room_on_the_pages_runs_move(pool: asyncpg.Pool, database_url: str) -> None:
    """The same runs with pages written full (`runs-fillfactor 100`): their new versions go to other
    pages. The setting takes effect on today's partition at once."""
    changed = await config_command("set", "runs-fillfactor", "100", "--database-url", database_url)
    assert changed.exit_code == 0, changed.output
    today = await pool.fetchval("SELECT format('runs_%s', to_char(now() AT TIME ZONE 'UTC', 'YYYYMMDD'))")
    assert await pool.fetchval("SELECT reloptions FROM pg_class WHERE relname = $1", today) == ["fillfactor=100"]
    fired, done = await fired_claimed_and_done(pool)
    assert sum(done[run] != page for run, page in fired.items()) > RUNS // 2


async def test_a_fillfactor_out_of_range_is_refused_and_changes_nothing(pool: asyncpg.Pool,
                                                                        database_url: str) -> None:
    for value in ("9", "0", "101", "forty", "40.5"):
        refused = await config_command("set", "runs-fillfactor", value, "--database-url", database_url)
        assert refused.exit_code == 2, refused.output
        assert "must be a whole number from 10 to 100" in refused.output
    assert await pool.fetchval("SELECT count(*) FROM settings") == 0
    reloptions = await pool.fetch(
        "SELECT reloptions FROM pg_class c JOIN pg_inherits i ON i.inhrelid = c.oid"
        " WHERE i.inhparent = 'runs'::regclass AND c.relname <> 'runs_default'"
        " AND c.relname >= format('runs_%s', to_char(now() AT TIME ZONE 'UTC', 'YYYYMMDD'))")
    assert reloptions and {tuple(r["reloptions"]) for r in reloptions} == {("fillfactor=40",)}
    unset = await config_command("unset", "runs-fillfactor", "--database-url", database_url)
    assert unset.exit_code == 0, unset.output
