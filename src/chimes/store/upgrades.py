"""Rolling upgrades: which releases are live, and what an upgrade to this release will do.

Every scheduler node and worker records its release with its heartbeat on each home it serves, and
every API server on the catalog. A contract step (chimes.store.migrate) removes what an older release
still uses, so it waits until no live process predates the release it names; processes of 0.1.0
record no release and always count as older. ``chimes migrate --plan`` prints :class:`UpgradePlan`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg

from chimes import __version__
from chimes.store.db import Conn
from chimes.store.migrate import Migration, applied_steps, migrations, release_key, release_needed
from chimes.store.queries import sql

UNRECORDED_RELEASE = "0.1.0 or earlier"  # what a process that records no release runs


@dataclass(frozen=True, slots=True)
class LiveProcess:
    role: str  # "scheduler", "worker" or "api"
    process_id: str
    release: str | None  # None: the process records no release (0.1.0 or earlier)

    def predates(self, release: str) -> bool:
        return self.release is None or release_key(self.release) < release_key(release)

    def __str__(self) -> str:
        return f"{self.role} {self.process_id} ({self.release or UNRECORDED_RELEASE})"


@dataclass(frozen=True, slots=True)
class HomePlan:
    """One database: the release its schema needs, its pending steps, its live processes."""

    home: str  # "catalog" or "shard N"
    release_needed: str | None  # None: any release runs on it
    expand: tuple[Migration, ...]
    contract: tuple[Migration, ...]
    live: tuple[LiveProcess, ...]


@dataclass(frozen=True, slots=True)
class UpgradePlan:
    release: str
    homes: tuple[HomePlan, ...]

    @property
    def too_old_for(self) -> str | None:
        """The release the schema needs when this one predates it (None: this release runs)."""
        needs = [h.release_needed for h in self.homes if h.release_needed is not None]
        needed = max(needs, key=release_key) if needs else None
        return needed if needed is not None and release_key(needed) > release_key(self.release) else None

    @property
    def live(self) -> list[LiveProcess]:
        """Live processes of every home, once each (a scheduler or worker serves every home under one id)."""
        return list(dict.fromkeys(p for home in self.homes for p in home.live))

    def blockers(self) -> list[tuple[Migration, list[LiveProcess]]]:
        """Each pending contract step with the live processes older than the release it needs."""
        steps = {m.version: m for home in self.homes for m in home.contract}
        found = []
        for step in sorted(steps.values(), key=lambda m: m.version):
            needs = step.contract_release or self.release
            older = [p for p in self.live if p.predates(needs)]
            if older:
                found.append((step, older))
        return found

    @property
    def can_contract(self) -> bool:
        return self.too_old_for is None and not self.blockers()

    def describe(self) -> str:
        lines = [f"upgrade to chimes {self.release}"]
        for home in self.homes:
            lines.append(f"{home.home}:")
            lines.append(f"  expand steps pending (applied by the first process of {self.release} to start): "
                         f"{_labels(home.expand)}")
            lines.append(f"  contract steps pending (applied by `chimes migrate --contract`): {_labels(home.contract)}")
        lines.append(f"live processes: {', '.join(map(str, self.live)) or 'none'}")
        needed = self.too_old_for
        if needed is not None:
            lines.append(f"cannot roll: the schema needs chimes {needed} or later; this is chimes {self.release}")
            return "\n".join(lines)
        lines.append(f"can roll: yes (start processes of {self.release} one at a time, in any order; each applies "
                     "the pending expand steps and works beside the processes of the release before)")
        if not any(home.contract for home in self.homes):
            lines.append("contract: nothing to contract")
        for step, older in self.blockers():
            lines.append(f"contract: {step.label} needs every process at {step.contract_release} or later; "
                         f"waiting for: {', '.join(map(str, older))}")
        if any(home.contract for home in self.homes) and self.can_contract:
            lines.append("contract: ready (`chimes migrate --contract`)")
        return "\n".join(lines)


def _labels(steps: Sequence[Migration]) -> str:
    return ", ".join(m.label for m in steps) or "none"


async def read_home_plan(conn: Conn, home: str, steps: Sequence[Migration] | None = None) -> HomePlan:
    """What an upgrade would do to this database; reads only."""
    applied = await applied_steps(conn)
    done = {step.version for step in applied}
    pending = [m for m in (migrations() if steps is None else steps) if m.version not in done]
    if not applied:  # a database no process has used yet: every step applies at start-up
        return HomePlan(home, None, tuple(pending), (), ())
    recorded = await conn.fetchval(sql("releases_recorded"))
    rows = await conn.fetch(sql("live_processes" if recorded else "live_processes_before_releases"))
    return HomePlan(home, release_needed(applied),
                    tuple(m for m in pending if m.contract_release is None),
                    tuple(m for m in pending if m.contract_release is not None),
                    tuple(LiveProcess(r["role"], r["id"], r["release"]) for r in rows))


def upgrade_plan(homes: Sequence[HomePlan], release: str = __version__) -> UpgradePlan:
    return UpgradePlan(release, tuple(homes))


async def heartbeat_api_server(conn: Conn | asyncpg.Pool, server_id: str, hostname: str, pid: int) -> None:
    await conn.execute(sql("heartbeat_api_server"), server_id, hostname, pid, __version__)


async def forget_api_server(conn: Conn | asyncpg.Pool, server_id: str) -> None:
    await conn.execute(sql("forget_api_server"), server_id)


async def forget_dead_api_servers(conn: Conn | asyncpg.Pool) -> None:
    await conn.execute(sql("forget_dead_api_servers"))
