"""Secrets at rest: values sealed with one key (Fernet: AES-128-CBC + HMAC-SHA256), opened only by
the worker right before a task runs, and never shown again by the API.

The key comes from ``CHIMES_SECRET_KEY`` or, without it, from a key file (``<data-dir>/secret.key``,
made on first use, mode 0600). Every process that seals or opens secrets (API, workers, the CLI's
owner and import commands) must use the same key; the database records the key's id so that a
process with another key fails at start-up, not on every run.

A job's secret values live beside the plain ones: ``task.secretHeaders`` (HTTP) and
``task.secretEnv`` (command, container). In the database they are sealed; on the API they read
as :data:`REDACTED`, and giving :data:`REDACTED` back in a PATCH keeps the stored value.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.fernet import Fernet, InvalidToken

from chimes.security.refusals import SecretNotKept

if TYPE_CHECKING:
    from chimes.jobs import JobSpec

log = logging.getLogger(__name__)

KEY_ENV = "CHIMES_SECRET_KEY"
KEY_FILE_NAME = "secret.key"
REDACTED = "********"
#: The task field holding secret values, by task type, on the wire (camelCase) and in the model.
SECRET_FIELDS = {"http": "secretHeaders", "command": "secretEnv", "container": "secretEnv"}
_MODEL_ATTRS = {"secretHeaders": "secret_headers", "secretEnv": "secret_env"}
#: Where a revealed secret goes in the task the executors see.
_PLAIN_FIELDS = {"secretHeaders": "headers", "secretEnv": "env"}
GENERATE_HINT = "python -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())'"


class SecretKeyError(RuntimeError):
    """The secret key is missing, malformed, or not the one this database's secrets were sealed with."""


class SecretUnreadable(ValueError):
    """A sealed value that this key cannot open."""


@dataclass(frozen=True, slots=True)
class Keyring:
    """One secret key: seals and opens values, and derives keyed fingerprints."""

    key: bytes  # a Fernet key: URL-safe base64 of 32 random bytes
    source: str = "a key given in code"

    @classmethod
    def from_text(cls, text: str, source: str) -> Keyring:
        key = text.strip().encode()
        try:
            Fernet(key)
        except ValueError:
            raise SecretKeyError(
                f"{source} does not hold a valid secret key (URL-safe base64 of 32 bytes); make one with: "
                f"{GENERATE_HINT}"
            ) from None
        return cls(key, source)

    @classmethod
    def generate(cls) -> Keyring:
        return cls(Fernet.generate_key(), "a generated key")

    @property
    def key_id(self) -> str:
        """A public name for the key (a keyed hash of a constant): safe to store and to print."""
        return hmac.new(self.key, b"chimes secret key id", hashlib.sha256).hexdigest()[:16]

    def seal(self, value: str) -> str:
        return Fernet(self.key).encrypt(value.encode()).decode()

    def open(self, sealed: str) -> str:
        try:
            return Fernet(self.key).decrypt(sealed.encode()).decode()
        except (InvalidToken, ValueError):
            raise SecretUnreadable("a secret value cannot be opened with this process's secret key") from None

    def fingerprint(self, data: bytes) -> bytes:
        """A keyed hash: unlike a plain one, it cannot be brute-forced back to a short secret."""
        return hmac.new(self.key, b"chimes fingerprint:" + data, hashlib.sha256).digest()


def load_keyring(secret_key: str | None, key_file: Path) -> Keyring:
    """The key from ``secret_key`` (``CHIMES_SECRET_KEY``), else from ``key_file``, made if missing."""
    if secret_key:
        return Keyring.from_text(secret_key, KEY_ENV)
    return Keyring.from_text(_read_or_create(key_file), f"the key file {key_file}")


def default_keyring() -> Keyring:
    """For processes built in code without settings: ``CHIMES_SECRET_KEY``, else the key file in
    ``CHIMES_SECRET_KEY_FILE`` or in the default data folder."""
    from chimes.settings import default_data_dir

    key_file = os.environ.get("CHIMES_SECRET_KEY_FILE") or default_data_dir() / KEY_FILE_NAME
    return load_keyring(os.environ.get(KEY_ENV), Path(key_file))


def _read_or_create(path: Path) -> str:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        spare = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        descriptor = os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(Fernet.generate_key() + b"\n")
            handle.flush()
            os.fsync(handle.fileno())
        try:  # link, not rename: of two processes starting at once, the first key wins for both
            with contextlib.suppress(FileExistsError):
                os.link(spare, path)
        finally:
            spare.unlink()
        log.info("made a new secret key in %s", path)
    if path.stat().st_mode & 0o077:
        log.warning("the secret key file %s can be read by other users: chmod 600 it", path)
    return path.read_text()


def secret_field(task: dict[str, Any]) -> str | None:
    """The wire name of the task's secret field (``secretHeaders`` or ``secretEnv``), if its type has one."""
    return SECRET_FIELDS.get(task.get("type", "")) if isinstance(task, dict) else None


def split_sealed(definition: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """A stored definition without its sealed values (so it validates as a JobSpec), and those values."""
    task = definition.get("task")
    if not isinstance(task, dict):
        return definition, {}
    field = secret_field(task)
    if field is None or field not in task:
        return definition, {}
    plain = dict(task)
    sealed = plain.pop(field) or {}
    return {**definition, "task": plain}, dict(sealed)


def seal_spec(spec: JobSpec, keyring: Keyring, kept: dict[str, str] | None = None) -> JobSpec:
    """The spec with its secret values sealed; a value of :data:`REDACTED` keeps the sealed value in
    ``kept`` (what is stored now) under the same name."""
    field = secret_field({"type": spec.task.type})
    values = getattr(spec.task, _MODEL_ATTRS[field], None) if field else None
    if field is None or not values:
        return spec
    stored = kept or {}
    sealed = {}
    for name, value in values.items():
        if value == REDACTED:
            if name not in stored:
                raise SecretNotKept(f"task.{field}.{name}")
            sealed[name] = stored[name]
        else:
            sealed[name] = keyring.seal(value)
    return _with_secrets(spec, field, sealed)


def keep_sealed(spec: JobSpec, kept: dict[str, str]) -> JobSpec:
    """Put stored (sealed) values back on a spec whose task a PATCH did not replace."""
    field = secret_field({"type": spec.task.type})
    if not kept or field is None:
        return spec
    return _with_secrets(spec, field, kept)


def _with_secrets(spec: JobSpec, field: str, values: dict[str, str]) -> JobSpec:
    # model_copy skips validation: a sealed value is longer than the limit on a plain one.
    task = spec.task.model_copy(update={_MODEL_ATTRS[field]: values})
    return spec.model_copy(update={"task": task})


def has_secrets(spec: JobSpec) -> bool:
    field = secret_field({"type": spec.task.type})
    return bool(field and getattr(spec.task, _MODEL_ATTRS[field], None))


def redact(definition: dict[str, Any]) -> dict[str, Any]:
    """A definition as the API shows it: every secret value replaced by :data:`REDACTED`."""
    task = definition.get("task")
    if not isinstance(task, dict):
        return definition
    field = secret_field(task)
    if field is None or not task.get(field):
        return definition
    return {**definition, "task": {**task, field: dict.fromkeys(task[field], REDACTED)}}


def reveal(task: dict[str, Any], keyring: Keyring) -> dict[str, Any]:
    """The task as the executors run it: secret values opened and merged into headers or env.

    Raises :class:`SecretUnreadable` naming the value when the key cannot open it.
    """
    field = secret_field(task)
    if field is None or not task.get(field):
        return task
    opened = {}
    for name, sealed in task[field].items():
        try:
            opened[str(name)] = keyring.open(str(sealed))
        except SecretUnreadable:
            raise SecretUnreadable(
                f"cannot open task.{field}.{name}: it was sealed with another secret key than this worker's"
            ) from None
    plain = {k: v for k, v in task.items() if k != field}
    plain[_PLAIN_FIELDS[field]] = {**(task.get(_PLAIN_FIELDS[field]) or {}), **opened}
    return plain
