"""The SQL loader: parameters named in a block are numbered at load and bound by name."""

from __future__ import annotations

import pytest

from chimes.store.jobs import _SPEC_SQL, SPEC_COLUMNS
from chimes.store.queries import Query, _blocks, _fragments, _load, parse, query, sql


def named(body: str) -> Query:
    parsed = parse("q", body)
    assert isinstance(parsed, Query)
    return parsed


def test_names_are_numbered_in_order_of_first_use() -> None:
    q = named("SELECT * FROM t WHERE a = $owner AND b = $job_id OR c = $owner")
    assert q.text == "SELECT * FROM t WHERE a = $1 AND b = $2 OR c = $1"
    assert q.names == ("owner", "job_id")
    assert q.args({"job_id": 7, "owner": "o"}) == ["o", 7]


def test_a_missing_name_is_refused() -> None:
    q = named("SELECT $a, $b")
    with pytest.raises(TypeError, match="missing b"):
        q.args({"a": 1})


def test_an_unknown_name_is_refused() -> None:
    q = named("SELECT $a")
    with pytest.raises(TypeError, match="unknown c"):
        q.args({"a": 1, "c": 2})


def test_a_cast_next_to_a_name() -> None:
    q = named("SELECT $ids::uuid[], $at::timestamptz, ($n)::int")
    assert q.text == "SELECT $1::uuid[], $2::timestamptz, ($3)::int"
    assert q.names == ("ids", "at", "n")


def test_dollar_quotes_strings_and_comments_are_left_alone() -> None:
    body = ("DO $body$ SELECT $inside $body$; SELECT $$ $also $$, '$quoted', \"$ident\", $x -- $comment\n"
            "/* $block */ FROM t$1")
    q = named(body)
    assert q.names == ("x",)
    assert q.text == body.replace(", $x ", ", $1 ")


def test_numbered_blocks_are_unchanged() -> None:
    body = "SELECT $1, $2::int, '$name' -- $other"
    assert parse("q", body) == body


def test_numbers_and_names_together_are_refused() -> None:
    with pytest.raises(ValueError, match="both"):
        parse("q", "SELECT $1, $a")


def test_a_name_must_be_lowercase() -> None:
    with pytest.raises(ValueError, match="lowercase"):
        parse("q", "SELECT $Owner")


def test_unnested_arrays_match_their_columns() -> None:
    named("SELECT * FROM unnest($slot_idx::integer[], $slot_run_id::uuid[]) AS s(idx, run_id)")
    with pytest.raises(ValueError, match="does not match"):
        parse("q", "SELECT * FROM unnest($slot_run_id::uuid[], $slot_idx::integer[]) AS s(idx, run_id)")
    with pytest.raises(ValueError, match="does not match"):
        parse("q", "SELECT * FROM unnest($slot_idx::integer[]) AS s(idx, run_id)")


def test_every_block_loads() -> None:
    assert _load()


def test_fragments_are_written_in_before_names_are_numbered() -> None:
    body = "INSERT INTO t (id, {cols}) VALUES ($id, {vals}) -- {not_a_fragment}"
    q = parse("q", body, {"cols": "a, b", "vals": "$a, $b"})
    assert isinstance(q, Query)
    assert q.text == "INSERT INTO t (id, a, b) VALUES ($1, $2, $3) -- {not_a_fragment}"
    assert q.names == ("id", "a", "b")
    with pytest.raises(ValueError, match="fragments"):
        parse("q", body)
    with pytest.raises(ValueError, match="fragments"):
        parse("q", body, {"cols": "a"})


def test_the_job_statements_name_every_column_of_a_definition() -> None:
    insert = query("insert_job", **_SPEC_SQL)
    assert set(insert.names) == {"job_id", "owner", "idempotency_key", "request_hash", *SPEC_COLUMNS}
    update = query("update_job", **_SPEC_SQL)
    assert set(update.names) == {"job_id", "paused", "actor", "pause_note", "moment", *SPEC_COLUMNS}


def test_a_named_query_is_not_read_as_numbered() -> None:
    with pytest.raises(TypeError, match="names its parameters"):
        sql("fire_triggers")
    with pytest.raises(TypeError, match="numbers its parameters"):
        query("get_job")


def test_identifiers_are_written_into_a_statement_that_cannot_take_them_as_parameters() -> None:
    assert sql("drop_tables", tables='"runs_p0_d1", "runs_p1_d1"').endswith('\nDROP TABLE "runs_p0_d1", "runs_p1_d1"')
    assert sql("create_database", database='"chimes"').endswith('\nCREATE DATABASE "chimes"')
    with pytest.raises(ValueError, match="fragments tables"):
        sql("drop_tables")


def test_every_block_with_fragments_is_one_whose_callers_fill_them() -> None:
    # A block with a {fragment} is not parsed until it is read with its fragments: each is listed
    # here, and read so in the tests above.
    assert {name for name, body in _blocks().items() if _fragments(body)} == {
        "insert_job", "update_job", "drop_tables", "create_database"}
