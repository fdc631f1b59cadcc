"""Owners' signing secrets and the secret key, above the store: made, sealed and opened here, stored
sealed by chimes.store.owners.

Every process that signs calls for an owner (workers, scheduler nodes sending notifications, the CLI)
first checks that its secret key is the one the database's secrets are sealed with: a process given
another key would sign with secrets nobody can verify, so it refuses to start instead.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from chimes.security.secrets import Keyring, SecretKeyError, default_keyring
from chimes.security.signing import new_signing_secret
from chimes.store.db import Conn, Pool
from chimes.store.owners import OwnerStore


async def check_secret_key(db: Pool | Conn, keyring: Keyring) -> None:
    """Record this key's id if the database has none; fail clearly if it holds another key's."""
    store = OwnerStore(db)
    recorded = await store.record_secret_key(keyring.key_id)
    if recorded is None:  # another process recorded its key while this statement ran: read what it wrote
        recorded = await store.recorded_secret_key()
    if recorded != keyring.key_id:
        raise SecretKeyError(
            f"this process's secret key (id {keyring.key_id}, from {keyring.source}) is not the key the secrets "
            f"in this database are sealed with (id {recorded}): give every Chimes process the same key, in "
            "CHIMES_SECRET_KEY or the key file (--secret-key-file)"
        )


async def signing_secret(store: OwnerStore, owner: str, keyring: Keyring, *, rotate: bool = False) -> str:
    """The owner's signing secret in clear, made (and stored sealed) if it has none or ``rotate``."""
    sealed = None if rotate else await store.sealed_signing_secret(owner)
    if sealed is None:
        sealed = await store.put_signing_secret(owner, keyring.seal(new_signing_secret()), rotate)
    return keyring.open(sealed)


_STALE = object()  # OwnerCache: no value read within its ttl (None can be a value)


class OwnerCache:
    """What a worker needs per owner, read at most once per ``ttl_sec``: a change by the operator
    (allowing commands, rotating the signing secret) reaches running workers within that time.

    Runs of one owner that find its entry missing or stale at the same moment (a worker's first
    claim of a burst, or every ``ttl_sec`` under load) wait for one read, not one read each; a
    caller cancelled meanwhile does not cancel the read the others wait for."""

    def __init__(self, store: OwnerStore, keyring: Keyring, ttl_sec: float = 30.0) -> None:
        self._store, self._keyring, self._ttl = store, keyring, ttl_sec
        self._entries: dict[tuple[str, str], tuple[float, Any]] = {}  # (what, owner): (fresh until, value)
        self._reading: dict[tuple[str, str], asyncio.Task[Any]] = {}

    async def allows_commands(self, owner: str) -> bool:
        allowed: bool = await self._cached("commands", owner, self._store.allows_commands)
        return allowed

    def fresh_signing_secret(self, owner: str) -> str | None:
        """The owner's signing secret if it was read within ``ttl_sec``, without waiting; None: it
        needs a read (:meth:`signing_secret`)."""
        fresh = self._fresh(("secret", owner))
        return None if fresh is _STALE else fresh

    async def signing_secret(self, owner: str) -> str:
        fresh = self.fresh_signing_secret(owner)  # what every run of a burst finds: no read to set up
        if fresh is not None:
            return fresh
        secret: str = await self._cached(
            "secret", owner, lambda owner: signing_secret(self._store, owner, self._keyring))
        return secret

    def _fresh(self, key: tuple[str, str]) -> Any:
        """The cached value, or ``_STALE`` when there is none read within ``ttl_sec``."""
        entry = self._entries.get(key)
        return entry[1] if entry is not None and entry[0] >= time.monotonic() else _STALE

    async def _cached(self, what: str, owner: str, read: Callable[[str], Awaitable[Any]]) -> Any:
        key = (what, owner)
        fresh = self._fresh(key)
        if fresh is not _STALE:
            return fresh
        reading = self._reading.get(key)
        if reading is None:
            reading = asyncio.ensure_future(self._read(key, read(owner)))
            self._reading[key] = reading
            reading.add_done_callback(lambda done: self._read_done(key, done))
        return await asyncio.shield(reading)

    async def _read(self, key: tuple[str, str], value: Awaitable[Any]) -> Any:
        read = await value
        self._entries[key] = (time.monotonic() + self._ttl, read)  # fresh for ttl_sec from when it came
        return read

    def _read_done(self, key: tuple[str, str], done: asyncio.Task[Any]) -> None:
        if self._reading.get(key) is done:
            del self._reading[key]
        if not done.cancelled():
            done.exception()  # retrieved: every waiter may have been cancelled, and each caller is told anyway


class SigningSecrets:
    """Owners' signing secrets for the calls a process makes on their behalf, opened with a key first
    checked against the database's: a process with another key signs nothing."""

    def __init__(self, pool: Pool, keyring: Keyring | None = None, ttl_sec: float = 30.0) -> None:
        self._pool, self._keyring, self._ttl = pool, keyring, ttl_sec
        self._cache: OwnerCache | None = None

    async def __call__(self, owner: str) -> str:
        """Raises SecretKeyError for a key that is not the database's, or a database error."""
        if self._cache is None:
            keyring = self._keyring or default_keyring()
            await check_secret_key(self._pool, keyring)
            self._cache = OwnerCache(OwnerStore(self._pool), keyring, self._ttl)
        return await self._cache.signing_secret(owner)
