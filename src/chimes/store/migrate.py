"""Versioned schema migrations: numbered ``.sql`` files applied once each, in order, under a lock.

Each migration is an expand step or a contract step (docs/operations.md, "Upgrades"). An expand step
only adds what a new release uses, so the release before runs on after it: every process applies
pending expand steps at start-up. A contract step removes what only older releases used; its file
opens with the line ``-- contract: requires every process at release >= X.Y.Z``, and it is applied by
``chimes migrate --contract`` once no process older than X.Y.Z is live (or on a database no process
has used yet). From the first contract step on, the applied migrations are recorded in
``chimes_migrations`` with the release each contract step needs; a process of a release below that
refuses to start and changes nothing, and release 0.1.0, which predates this check, fails on reading
``schema_migrations``, now a view that raises the same message.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import asyncpg
from packaging.version import Version

from chimes import __version__
from chimes.store.db import Conn
from chimes.store.queries import sql

log = logging.getLogger(__name__)

_LOCK_KEY = 0x43484D53  # "CHMS": one migrator at a time across every process
RUN_PARTITION_DAYS_AHEAD = 7
CONTRACT_MARKER = "-- contract: requires every process at release >= "
_RELEASE = re.compile(r"\d+\.\d+\.\d+")


class ReleaseTooOld(Exception):
    """The database's schema has had a contract step that this release predates."""


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str
    contract_release: str | None = None  # a contract step: the oldest release that runs after it

    @property
    def label(self) -> str:
        return f"{self.version:04d}_{self.name}"


@dataclass(frozen=True, slots=True)
class AppliedStep:
    version: int
    name: str
    contract_release: str | None


def release_key(release: str) -> tuple[int, ...]:
    """Releases compare by their numbers: 0.10.0 is after 0.9.0. A development build between releases
    (``0.3.4.dev0``, what the code reports after 0.3.3) counts as the release it leads to: it carries
    that release's migrations, contract steps included, and the code that goes with them."""
    return Version(release).release


def parse_migration(file_name: str, text: str) -> Migration:
    """A migration from its file; a first line that starts like the contract marker but does not
    name a release X.Y.Z is an error, not an expand step by mistake."""
    number, _, rest = file_name.partition("_")
    first_line = text.split("\n", 1)[0].strip()
    contract_release = None
    if first_line.startswith("-- contract"):
        release = first_line.removeprefix(CONTRACT_MARKER)
        if not first_line.startswith(CONTRACT_MARKER) or not _RELEASE.fullmatch(release):
            raise ValueError(f"migration {file_name}: a contract step opens with "
                             f"'{CONTRACT_MARKER}X.Y.Z', not {first_line!r}")
        contract_release = release
    return Migration(int(number), rest.removesuffix(".sql"), text, contract_release)


def migrations() -> list[Migration]:
    folder = resources.files("chimes.store") / "migrations"
    found = [parse_migration(entry.name, entry.read_text()) for entry in folder.iterdir()
             if entry.name.endswith(".sql")]
    return sorted(found, key=lambda m: m.version)


async def applied_steps(conn: Conn) -> list[AppliedStep]:
    """The migrations applied to this database, by whichever release applied them."""
    layout = await conn.fetchval(sql("migrations_layout"))
    if layout == "new":
        return []
    rows = await conn.fetch(sql("applied_steps" if layout == "contracted" else "applied_steps_before_contract"))
    return [AppliedStep(r["version"], r["name"], r["contract_release"]) for r in rows]


def release_needed(applied: Sequence[AppliedStep]) -> str | None:
    """The oldest release that may run on a schema with these steps applied (None: any release)."""
    needs = [step.contract_release for step in applied if step.contract_release is not None]
    return max(needs, key=release_key) if needs else None


def refuse_if_too_old(applied: Sequence[AppliedStep], release: str = __version__) -> None:
    needed = release_needed(applied)
    if needed is not None and release_key(needed) > release_key(release):
        steps = ", ".join(f"{s.version:04d}_{s.name}" for s in applied
                          if s.contract_release and release_key(s.contract_release) > release_key(release))
        raise ReleaseTooOld(f"this database's schema needs chimes {needed} or later (contract migration {steps} "
                            f"was applied); this is chimes {release}: run chimes {needed} or later")


async def migrate(conn: asyncpg.Connection, *, contract: bool = False,
                  steps: Sequence[Migration] | None = None, release: str = __version__) -> list[int]:
    """Apply every pending expand step, and with ``contract`` the pending contract steps too (the
    caller has checked that no older process is live: chimes.store.upgrades); on a database no
    process has used yet, every step. Return the versions applied. Safe to run from many processes.
    Raises :class:`ReleaseTooOld`, having changed nothing, when ``release`` predates the schema."""
    await conn.execute(sql("lock_migrations"), _LOCK_KEY)
    try:
        applied = await applied_steps(conn)
        refuse_if_too_old(applied, release)
        if not applied:
            await conn.execute(sql("create_schema_migrations"))
        done = {step.version for step in applied}
        contracted = any(step.contract_release for step in applied)
        newly_applied = []
        for migration in migrations() if steps is None else steps:
            if migration.version in done:
                continue
            if migration.contract_release is not None and not (contract or not applied):
                log.info("contract migration %s waits for `chimes migrate --contract`", migration.label)
                continue
            await _apply(conn, migration, contracted)
            contracted = contracted or migration.contract_release is not None
            newly_applied.append(migration.version)
        await ensure_run_partitions(conn)
        return newly_applied
    finally:
        if not conn.is_closed():  # a lost session has released its locks already
            await conn.execute(sql("unlock_migrations"), _LOCK_KEY)


async def _apply(conn: asyncpg.Connection, migration: Migration, contracted: bool) -> None:
    # In one transaction: applied and recorded together, or neither.
    async with conn.transaction():
        if migration.contract_release is not None and not contracted:
            await conn.execute(sql("contract_layout"))
            contracted = True
        await conn.execute(migration.sql)
        if contracted:
            await conn.execute(sql("record_step"), migration.version, migration.name, migration.contract_release)
        else:
            await conn.execute(sql("record_migration"), migration.version, migration.name)
    kind = "contract" if migration.contract_release else "expand"
    log.info("applied %s migration %s", kind, migration.label)


async def ensure_run_partitions(conn: Conn | asyncpg.Pool, days_ahead: int = RUN_PARTITION_DAYS_AHEAD) -> int:
    """Create the run-history partitions from yesterday to ``days_ahead`` days from now."""
    created: int = await conn.fetchval(sql("ensure_run_partitions"), days_ahead + 2)
    return created
