"""What a worker checks and adds before a task runs (docs/security.md).

- Command and container tasks run only on a worker started with ``--allow-commands``, and only for
  an owner the operator allows. The API already refuses such jobs for other owners; this is the
  second line, for jobs made before a permission was withdrawn or written around the API.
- Secret values are opened here, right before the run, and only in memory.
- HTTP tasks get their owner's signing secret, to sign the request with.

A refusal fails the attempt with a message saying what to change; it never raises.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from chimes.security.secrets import Keyring, SecretKeyError, SecretUnreadable, default_keyring, reveal
from chimes.services.jobs import COMMAND_TASK_TYPES
from chimes.services.owners import OwnerCache, check_secret_key
from chimes.store.db import DB_ERRORS, Pool, describe
from chimes.store.owners import OwnerStore
from chimes.store.working import ClaimedRun

log = logging.getLogger(__name__)


class PreparedTask(NamedTuple):  # one a run: a named tuple is cheaper to make than a frozen dataclass
    task: dict[str, Any] | None = None
    signing_secret: str | None = None
    refusal: str | None = None


class TaskGuard:
    def __init__(self, pool: Pool, keyring: Keyring | None = None, *, allow_commands: bool = False,
                 cache_ttl_sec: float = 30.0) -> None:
        self.allow_commands = allow_commands
        self._pool = pool
        self._keyring = keyring
        self._ttl = cache_ttl_sec
        self._owners: OwnerCache | None = None
        self._key_checked = False

    async def start(self) -> None:
        """Load the secret key and check it against the database's: a wrong key is a start-up error
        (SecretKeyError), not a failure of every run. A database that is down is checked later."""
        keyring = self._keyring or default_keyring()
        self._keyring = keyring
        self._owners = OwnerCache(OwnerStore(self._pool), keyring, self._ttl)
        try:
            await check_secret_key(self._pool, keyring)
            self._key_checked = True
        except DB_ERRORS as exc:
            log.warning("could not check the secret key against the database yet: %s", describe(exc))

    def ready(self, run: ClaimedRun) -> PreparedTask | None:
        """What :meth:`prepare` gives ``run`` when that needs nothing read: the key checked, a task
        that is not a command, and for an HTTP task its owner's signing secret fresh in the cache, as
        for every run of a burst after its first. None: await :meth:`prepare`. The worker asks this
        first for every run, without making a coroutine for it."""
        if not self._key_checked or self._owners is None or self._keyring is None:
            return None
        task = run.task or {}
        task_type = task.get("type")
        if task_type in COMMAND_TASK_TYPES:  # its owner's permission may need a read
            return None
        secret = None
        if task_type == "http":
            secret = self._owners.fresh_signing_secret(run.owner)
            if secret is None:
                return None
        try:
            return PreparedTask(reveal(task, self._keyring), secret)
        except SecretUnreadable as exc:
            return PreparedTask(refusal=str(exc))

    async def prepare(self, run: ClaimedRun) -> PreparedTask:
        if not self._key_checked:
            try:
                await self.start()
            except SecretKeyError as exc:
                return PreparedTask(refusal=str(exc))
            if not self._key_checked:
                return PreparedTask(refusal="cannot check the secret key against the database (see the worker log)")
        assert self._owners is not None and self._keyring is not None
        task = run.task or {}
        task_type = task.get("type")
        owner = run.owner
        try:
            if task_type in COMMAND_TASK_TYPES:
                refusal = await self._command_refusal(owner, task_type)
                if refusal is not None:
                    return PreparedTask(refusal=refusal)
            opened = reveal(task, self._keyring)
            secret = await self._owners.signing_secret(owner) if task_type == "http" else None
        except SecretUnreadable as exc:
            return PreparedTask(refusal=str(exc))
        except DB_ERRORS as exc:
            return PreparedTask(refusal=f"cannot read the settings of owner {owner!r}: {describe(exc)}")
        return PreparedTask(opened, secret)

    async def _command_refusal(self, owner: str, task_type: str) -> str | None:
        assert self._owners is not None
        if not self.allow_commands:
            return (f"refused: this worker does not run {task_type} tasks; start workers with --allow-commands "
                    "(CHIMES_ALLOW_COMMANDS=true) to run them")
        if not await self._owners.allows_commands(owner):
            return (f"refused: owner {owner!r} may not run {task_type} tasks; an operator allows it with "
                    f"`chimes owner set {owner} --allow-commands`")
        return None
