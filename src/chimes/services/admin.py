"""The operator's changes made on the database with the command line (``chimes token``, ``chimes cap``,
``chimes owner``), each written together with its audit entry in one transaction on the catalog (where
tokens, caps and owners live), so the trail holds every one of them (docs/security.md, "Audit trail").
"""

from __future__ import annotations

import getpass
import os
import socket
import uuid
from datetime import UTC, datetime
from typing import Any

from chimes.security.secrets import Keyring
from chimes.services import owners as owner_secrets
from chimes.store import caps as cap_store
from chimes.store import tokens as token_store
from chimes.store.audit import Actor, AuditNote, record
from chimes.store.db import Connection
from chimes.store.owners import OwnerSettings, OwnerStore

#: The actor's owner on entries made with the command line: there is no token, only database access.
OPERATOR = "operator"


def command_line_note(now: datetime | None = None) -> AuditNote:
    """Who is changing something from this command line: the operating-system user on this host."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container): the number says who
        user = f"uid {os.getuid()}"
    return AuditNote(Actor(OPERATOR, None, f"{user}@{socket.gethostname()}"), now or datetime.now(UTC))


async def create_token(conn: Connection, note: AuditNote, owner: str, scope: str, name: str | None) -> str:
    async with conn.transaction():
        token = await token_store.create_token(conn, owner, scope=scope, name=name)
        principal = await token_store.authenticate(conn, token)
        assert principal is not None and principal.token_id is not None  # made a statement ago, in this transaction
        await record(conn, note, "token.create", f"token {principal.token_id}", None,
                     {"tokenId": str(principal.token_id), "owner": owner, "scope": scope, "name": name},
                     subject_owner=owner)
    return token


async def revoke_token(conn: Connection, note: AuditNote, token_id: uuid.UUID) -> bool:
    async with conn.transaction():
        if not await token_store.revoke_token(conn, token_id):
            return False
        revoked = next(t for t in await token_store.list_tokens(conn) if t.token_id == token_id)
        await record(conn, note, "token.revoke", f"token {token_id}", {"revokedAt": None},
                     {"revokedAt": revoked.revoked_at.isoformat() if revoked.revoked_at else None},
                     subject_owner=revoked.owner)
    return True


def _cap_subject(scope: str, name: str, owner: str) -> tuple[str, str | None]:
    subject = f"cap {scope}:{name}" + (f" of {owner}" if owner else "")
    return subject, (name if scope == "owner" else owner or None)


async def set_cap(conn: Connection, note: AuditNote, cap: cap_store.Cap) -> None:
    async with conn.transaction():
        before = _cap_fields(await _find_cap(conn, cap.scope, cap.name, cap.owner))
        await cap_store.set_cap(conn, cap)
        subject, whose = _cap_subject(cap.scope, cap.name, cap.owner)
        await record(conn, note, "cap.set", subject, before, _cap_fields(cap), subject_owner=whose)


async def remove_cap(conn: Connection, note: AuditNote, scope: str, name: str, owner: str) -> bool:
    async with conn.transaction():
        before = await _find_cap(conn, scope, name, owner)
        if not await cap_store.remove_cap(conn, scope, name, owner):
            return False
        subject, whose = _cap_subject(scope, name, owner)
        await record(conn, note, "cap.delete", subject, _cap_fields(before), None, subject_owner=whose)
    return True


async def _find_cap(conn: Connection, scope: str, name: str, owner: str) -> cap_store.Cap | None:
    return next((c for c in await cap_store.list_caps(conn) if (c.scope, c.name, c.owner) == (scope, name, owner)),
                None)


def _cap_fields(cap: cap_store.Cap | None) -> dict[str, Any] | None:
    return None if cap is None else {"maxRunning": cap.max_running}


async def set_owner(conn: Connection, note: AuditNote, owner: str, *, allow_commands: bool | None,
                    job_quota: int | None, default_quota: bool) -> OwnerSettings:
    async with conn.transaction():
        store = OwnerStore(conn)
        before = await store.get(owner)
        await store.set(owner, allow_commands=allow_commands, job_quota=job_quota, default_quota=default_quota)
        after = await store.get(owner)
        assert after is not None  # set makes the row
        await record(conn, note, "owner.update", f"owner {owner}", _owner_fields(before), _owner_fields(after),
                     subject_owner=owner)
    return after


def _owner_fields(settings: OwnerSettings | None) -> dict[str, Any]:
    if settings is None:  # a new owner: the defaults
        return {"allowCommands": False, "jobQuota": None}
    return {"allowCommands": settings.allow_commands, "jobQuota": settings.job_quota}


async def signing_secret(conn: Connection, note: AuditNote, owner: str, keyring: Keyring, *, rotate: bool) -> str:
    """The owner's signing secret in clear; making or replacing it is recorded (never the secret: the
    entry says only that it was made or replaced)."""
    async with conn.transaction():
        store = OwnerStore(conn)
        before = await store.sealed_signing_secret(owner)
        secret = await owner_secrets.signing_secret(store, owner, keyring, rotate=rotate)
        if before is None or rotate:
            await record(conn, note, "owner.signing_secret", f"owner {owner}",
                         {"signingSecret": None if before is None else "set"},
                         {"signingSecret": "replaced" if before is not None else "set"}, subject_owner=owner)
    return secret
