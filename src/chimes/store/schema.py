"""The canonical schema: what the numbered migrations produce, kept in ``store/schema.sql``.

The file is read back from PostgreSQL's catalog of a freshly migrated database, not written by hand,
so it says what the server holds: tables with their columns in order, constraints, indexes,
triggers, sequences, types, views and functions. Owners, grants and the day partitions of run
history (named for the day the migration ran) are left out, so the text is the same on every server
and every day. ``tests/integration/test_schema.py`` migrates an empty database and compares.

Regenerate after adding a migration::

    python -m chimes.store.schema --write     # on the embedded server, or CHIMES_DATABASE_URL's
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections import defaultdict
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from chimes.store.db import Conn
from chimes.store.queries import sql

SCHEMA_FILE = Path(__file__).with_name("schema.sql")
HEADER = """\
-- The schema the migrations in src/chimes/store/migrations produce, read back from the catalog of
-- a freshly migrated database (chimes.store.schema). Generated: do not edit. After adding a
-- migration: python -m chimes.store.schema --write
-- Left out: owners and grants, and the day partitions of runs and run_attempts, which
-- chimes_ensure_run_partitions makes as days come.
"""


async def describe(conn: Conn) -> str:
    """The schema of the database ``conn`` is on, as the text of ``schema.sql``."""
    tables = await conn.fetch(sql("catalog_tables"))
    oids = [t["oid"] for t in tables]
    columns: dict[int, list[str]] = defaultdict(list)
    for c in await conn.fetch(sql("catalog_columns"), oids):
        columns[c["table_oid"]].append(_column(c))
    constraints: dict[int, list[str]] = defaultdict(list)
    for c in await conn.fetch(sql("catalog_constraints"), oids):
        constraints[c["table_oid"]].append(f"    CONSTRAINT {c['name']} {c['definition']}")
    indexes: dict[int, list[str]] = defaultdict(list)
    for i in await conn.fetch(sql("catalog_indexes"), oids):
        indexes[i["table_oid"]].append(i["definition"] + ";")

    out = [HEADER]
    for t in await conn.fetch(sql("catalog_types")):
        out.append(_type(t))
    for s in await conn.fetch(sql("catalog_sequences")):
        out.append(f"CREATE SEQUENCE {s['name']} AS {s['type']} START {s['start']} INCREMENT {s['increment']} "
                   f"MINVALUE {s['min']} MAXVALUE {s['max']} CACHE {s['cache']}{' CYCLE' if s['cycle'] else ''};")
    for t in tables:
        out.append(_table(t, columns[t["oid"]] + constraints[t["oid"]], indexes[t["oid"]]))
    for v in await conn.fetch(sql("catalog_views")):
        kind = "MATERIALIZED VIEW" if v["relkind"] == "m" else "VIEW"
        out.append(f"CREATE {kind} {v['name']} AS\n{v['definition'].rstrip().rstrip(';')};")
    for f in await conn.fetch(sql("catalog_functions")):
        out.append(f["definition"].rstrip() + ";")
    triggers = await conn.fetch(sql("catalog_triggers"), oids)
    if triggers:
        out.append("\n".join(t["definition"] + ";" for t in triggers))
    return "\n\n".join(part.rstrip("\n") for part in out) + "\n"


def _column(c: asyncpg.Record) -> str:
    text = f"    {c['name']} {c['type']}"
    if c["identity"]:
        text += f" GENERATED {'ALWAYS' if c['identity'] == 'a' else 'BY DEFAULT'} AS IDENTITY"
    elif c["generated"]:
        text += f" GENERATED ALWAYS AS ({c['default_expr']}) {'STORED' if c['generated'] == 's' else 'VIRTUAL'}"
    elif c["default_expr"] is not None:
        text += f" DEFAULT {c['default_expr']}"
    return text + (" NOT NULL" if c["not_null"] else "")


def _table(t: asyncpg.Record, body: list[str], indexes: list[str]) -> str:
    unlogged = "UNLOGGED " if t["relpersistence"] == "u" else ""
    if t["parent"] is not None:  # a partition has its parent's columns
        head = f"CREATE {unlogged}TABLE {t['name']} PARTITION OF {t['parent']} {t['bound']}"
    else:
        head = f"CREATE {unlogged}TABLE {t['name']} (\n" + ",\n".join(body) + "\n)"
    if t["partition_key"]:
        head += f" PARTITION BY {t['partition_key']}"
    if t["reloptions"]:
        head += f" WITH ({', '.join(t['reloptions'])})"
    return "\n".join([head + ";", *indexes])


def _type(t: asyncpg.Record) -> str:
    if t["kind"] == "e":
        return f"CREATE TYPE {t['name']} AS ENUM ({', '.join(t['labels'] or [])});"
    text = f"CREATE DOMAIN {t['name']} AS {t['base_type']}"
    if t["default_expr"] is not None:
        text += f" DEFAULT {t['default_expr']}"
    if t["not_null"]:
        text += " NOT NULL"
    return text + "".join(f" {check}" for check in t["checks"] or []) + ";"


async def migrated_schema(server_dsn: str) -> str:
    """Migrate a new, empty database on the server with the real migrations, describe it, drop it."""
    from chimes.store.migrate import migrate  # migrate imports the store; keep this module light

    name = f"chimes_schema_{os.getpid()}"
    admin = await asyncpg.connect(server_dsn)
    try:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.execute(f"CREATE DATABASE {name} TEMPLATE template0")
        conn = await asyncpg.connect(_with_database(server_dsn, name))
        try:
            await migrate(conn)
            return await describe(conn)
        finally:
            await conn.close()
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()


def _with_database(dsn: str, name: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


def _server() -> contextlib.AbstractContextManager[str]:
    """CHIMES_DATABASE_URL's server, or an embedded one of its own in a temporary folder."""
    from chimes.store.embedded import server_for_a_while

    return server_for_a_while("chimes-schema-pg-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chimes.store.schema",
                                     description="The schema the migrations produce, read from the catalog.")
    parser.add_argument("--write", action="store_true", help=f"write {SCHEMA_FILE.name} instead of printing it")
    args = parser.parse_args(argv)
    with _server() as dsn:
        text = asyncio.run(migrated_schema(dsn))
    if args.write:
        SCHEMA_FILE.write_text(text)
        print(f"wrote {SCHEMA_FILE}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
