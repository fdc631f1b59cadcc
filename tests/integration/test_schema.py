"""The canonical schema (src/chimes/store/schema.sql) is what the migrations produce."""

from __future__ import annotations

import difflib

import asyncpg
import pytest

from chimes.store.schema import SCHEMA_FILE, describe, migrated_schema


def _diff(expected: str, actual: str) -> str:
    return "".join(difflib.unified_diff(expected.splitlines(keepends=True), actual.splitlines(keepends=True),
                                        fromfile=str(SCHEMA_FILE), tofile="migrated database"))


async def test_migrations_produce_the_canonical_schema(server_dsn: str) -> None:
    actual = await migrated_schema(server_dsn)
    diff = _diff(SCHEMA_FILE.read_text(), actual)
    if diff:
        pytest.fail("the migrations do not produce store/schema.sql (regenerate it with "
                    f"`python -m chimes.store.schema --write` if the change is meant):\n{diff}", pytrace=False)


async def test_a_schema_change_shows_in_the_description(database_url: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        before = await describe(conn)
        await conn.execute("ALTER TABLE jobs ADD COLUMN colour text DEFAULT 'red' NOT NULL")
        await conn.execute("CREATE INDEX jobs_colour ON jobs (colour)")
        await conn.execute("SELECT chimes_ensure_run_partitions('2031-01-01', 3)")  # day partitions: left out
        after = await describe(conn)
    finally:
        await conn.close()
    added = [line for line in _diff(before, after).splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert added == [
        "+    colour text DEFAULT 'red'::text NOT NULL,",
        "+CREATE INDEX jobs_colour ON public.jobs USING btree (colour);",
    ]
