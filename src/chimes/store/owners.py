"""Owners (teams) as the operator configures them: command tasks allowed, job quota, signing secret.

The settings live in the database because the API (quota, command jobs) and the workers (command
tasks, signing) are separate processes that must agree. Signing secrets are sealed with the secret
key (chimes.security.secrets) and made on first use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import asyncpg

from chimes.security.secrets import Keyring, SecretKeyError, default_keyring
from chimes.security.signing import new_signing_secret
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

    async def signing_secret(self, owner: str, keyring: Keyring, *, rotate: bool = False) -> str:
        """The owner's signing secret in clear, made (and stored sealed) if it has none or ``rotate``."""
        sealed = None if rotate else await self._db.fetchval(sql("signing_secret"), owner)
        if sealed is None:
            fresh = keyring.seal(new_signing_secret())
            sealed = await self._db.fetchval(sql("put_signing_secret"), owner, fresh, rotate)
        return keyring.open(sealed)


async def check_secret_key(db: asyncpg.Pool | asyncpg.Connection, keyring: Keyring) -> None:
    """Record this key's id if the database has none; fail clearly if it holds another key's."""
    recorded = await db.fetchval(sql("record_secret_key"), keyring.key_id)
    if recorded is None:  # another process recorded its key while this statement ran: read what it wrote
        recorded = await db.fetchval(sql("recorded_secret_key"))
    if recorded != keyring.key_id:
        raise SecretKeyError(
            f"this process's secret key (id {keyring.key_id}, from {keyring.source}) is not the key the secrets "
            f"in this database are sealed with (id {recorded}): give every Chimes process the same key, in "
            "CHIMES_SECRET_KEY or the key file (--secret-key-file)"
        )


class OwnerCache:
    """What a worker needs per owner, read at most once per ``ttl_sec``: a change by the operator
    (allowing commands, rotating the signing secret) reaches running workers within that time."""

    def __init__(self, store: OwnerStore, keyring: Keyring, ttl_sec: float = 30.0) -> None:
        self._store, self._keyring, self._ttl = store, keyring, ttl_sec
        self._commands: dict[str, tuple[float, bool]] = {}
        self._secrets: dict[str, tuple[float, str]] = {}

    async def allows_commands(self, owner: str) -> bool:
        cached = self._commands.get(owner)
        if cached is None or cached[0] < time.monotonic():
            cached = (time.monotonic() + self._ttl, await self._store.allows_commands(owner))
            self._commands[owner] = cached
        return cached[1]

    async def signing_secret(self, owner: str) -> str:
        cached = self._secrets.get(owner)
        if cached is None or cached[0] < time.monotonic():
            cached = (time.monotonic() + self._ttl, await self._store.signing_secret(owner, self._keyring))
            self._secrets[owner] = cached
        return cached[1]


class SigningSecrets:
    """Owners' signing secrets for the calls a process makes on their behalf, opened with a key first
    checked against the database's: a process with another key signs nothing."""

    def __init__(self, pool: asyncpg.Pool, keyring: Keyring | None = None, ttl_sec: float = 30.0) -> None:
        self._pool, self._keyring, self._ttl = pool, keyring, ttl_sec
        self._cache: OwnerCache | None = None

    async def __call__(self, owner: str) -> str:
        """Raises SecretKeyError for a key that is not the database's, or a database error."""
        if self._cache is None:
            keyring = self._keyring or default_keyring()
            await check_secret_key(self._pool, keyring)
            self._cache = OwnerCache(OwnerStore(self._pool), keyring, self._ttl)
        return await self._cache.signing_secret(owner)


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
