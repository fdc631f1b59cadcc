"""Owners' signing secrets and the secret key, above the store: made, sealed and opened here, stored
sealed by chimes.store.owners.

Every process that signs calls for an owner (workers, scheduler nodes sending notifications, the CLI)
first checks that its secret key is the one the database's secrets are sealed with: a process given
another key would sign with secrets nobody can verify, so it refuses to start instead.
"""

from __future__ import annotations

import time

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
            cached = (time.monotonic() + self._ttl, await signing_secret(self._store, owner, self._keyring))
            self._secrets[owner] = cached
        return cached[1]


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
