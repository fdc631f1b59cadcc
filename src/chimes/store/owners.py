"""Owners (teams) as the operator configures them: command tasks allowed, job quota, signing secret.

The settings live in the database because the API (quota, command jobs) and the workers (command
tasks, signing) are separate processes that must agree. Signing secrets are stored sealed; making,
sealing and opening them is chimes.services.owners' business, not the store's.
"""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg

from chimes.store.db import Conn, one_row
from chimes.store.queries import sql


@dataclass(frozen=True, slots=True)
class OwnerSettings:
    owner: str
    allow_commands: bool
    job_quota: int | None  # None: the API's default quota
    has_signing_secret: bool
    jobs: int


class OwnerStore:
    def __init__(self, pool: asyncpg.Pool | Conn) -> None:
        self._db = pool

    async def get(self, owner: str) -> OwnerSettings | None:
        row = await self._db.fetchrow(sql("get_owner"), owner)
        return None if row is None else OwnerSettings(**dict(row))

    async def list(self) -> list[OwnerSettings]:
        return [OwnerSettings(**dict(row)) for row in await self._db.fetch(sql("list_owners"))]

    async def set(self, owner: str, *, allow_commands: bool | None = None, job_quota: int | None = None,
                  default_quota: bool = False) -> None:
        """Change what is given; ``default_quota=True`` makes the owner use the API's default quota again."""
        await self._db.execute(sql("set_owner"), owner, allow_commands, job_quota, default_quota)

    async def allows_commands(self, owner: str) -> bool:
        return bool(await self._db.fetchval(sql("owner_allows_commands"), owner))

    async def sealed_signing_secret(self, owner: str) -> str | None:
        """The owner's signing secret as stored (sealed), or None if it has none yet."""
        sealed: str | None = await self._db.fetchval(sql("signing_secret"), owner)
        return sealed

    async def put_signing_secret(self, owner: str, sealed: str, replace: bool) -> str:
        """Store a sealed signing secret, unless the owner has one and not ``replace``: returns the one
        stored (another process may have made one first)."""
        stored: str = await self._db.fetchval(sql("put_signing_secret"), owner, sealed, replace)
        return stored

    async def record_secret_key(self, key_id: str) -> str | None:
        """Record this key's id if the database has none yet; returns the id recorded (None when another
        process recorded one while this statement ran)."""
        recorded: str | None = await self._db.fetchval(sql("record_secret_key"), key_id)
        return recorded

    async def recorded_secret_key(self) -> str | None:
        recorded: str | None = await self._db.fetchval(sql("recorded_secret_key"))
        return recorded


@dataclass(frozen=True, slots=True)
class OwnerLimits:
    allow_commands: bool
    job_quota: int | None  # None: the API's default quota


async def lock_owner_for_job(conn: Conn, owner: str) -> OwnerLimits:
    """Inside a job's create transaction: make the owner's row if missing and lock it, so concurrent
    creates for one owner count their jobs one after the other."""
    row = one_row(await conn.fetchrow(sql("lock_owner_for_job"), owner))
    return OwnerLimits(row["allow_commands"], row["job_quota"])


async def count_jobs_up_to(conn: Conn, owner: str, limit: int) -> int:
    """How many jobs the owner has, counting no further than ``limit``."""
    count: int = await conn.fetchval(sql("count_owner_jobs_up_to"), owner, limit)
    return count
