"""The enums agree with the database: its CHECK constraints allow exactly their values, and the rows
the store writes carry them (``tests/unit/test_enums.py`` scans the SQL text for the rest)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import asyncpg

from chimes.enums import Priority, RunStatus, RunTrigger, TriggerKind
from chimes.jobs import JobSpec
from chimes.services.jobs import JobService


async def check_of(pool: asyncpg.Pool, name: str) -> str:
    definition = await pool.fetchval("SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = $1", name)
    assert definition is not None, f"no constraint {name}"
    return definition


async def test_check_constraints_allow_exactly_the_enum_values(pool: asyncpg.Pool) -> None:
    statuses = set(re.findall(r"'(\w+)'::text", await check_of(pool, "runs_status")))
    assert statuses == {str(status) for status in RunStatus}
    triggers = set(re.findall(r"'(\w+)'::text", await check_of(pool, "runs_trigger")))
    assert triggers == {str(trigger) for trigger in RunTrigger}
    low, high = map(int, re.findall(r"\d+", await check_of(pool, "jobs_priority")))
    assert set(range(low, high + 1)) == {int(tier) for tier in Priority}


async def test_stored_rows_carry_the_enum_values(pool: asyncpg.Pool) -> None:
    store = JobService(pool)
    spec = JobSpec.model_validate({"name": "e", "schedule": {"cron": "* * * * *"}, "priority": "batch",
                                   "task": {"type": "http", "url": "http://127.0.0.1:9/"}})
    created = await store.create("team-a", spec, datetime.now(UTC))
    row = await pool.fetchrow("SELECT priority FROM jobs WHERE job_id = $1", created.job_id)
    assert row["priority"] == Priority.BATCH
    kinds = await pool.fetch("SELECT kind FROM triggers WHERE job_id = $1", created.job_id)
    assert [r["kind"] for r in kinds] == [TriggerKind.SCHEDULE]
    # A run written with a member of each enum is accepted by the constraints, and reads back equal.
    await pool.execute(
        "INSERT INTO runs (run_id, scheduled_at, job_id, owner, partition_id, job_version, trigger, priority, status) "
        "SELECT gen_random_uuid(), $2, job_id, owner, 0, version, $3, $4, $5 FROM jobs WHERE job_id = $1",
        created.job_id, datetime.now(UTC) + timedelta(hours=1), RunTrigger.MANUAL, Priority.HIGH, RunStatus.SKIPPED)
    run = await pool.fetchrow("SELECT trigger, priority, status FROM runs WHERE job_id = $1", created.job_id)
    assert (run["trigger"], run["priority"], run["status"]) == (RunTrigger.MANUAL, Priority.HIGH, RunStatus.SKIPPED)
