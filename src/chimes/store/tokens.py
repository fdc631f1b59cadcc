"""API tokens: random secrets shown once, stored only as SHA-256 hashes, each with an owner and a scope."""

from __future__ import annotations

import hashlib
import secrets
import uuid
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from chimes.store.owners import OwnerStore
from chimes.store.queries import sql

TOKEN_PREFIX = "chm_"
#: What a token may do: ``read`` only reads its owner's jobs and runs, ``write`` also changes them,
#: ``admin`` reads and changes every owner's.
SCOPES = ("read", "write", "admin")


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a team (owner) with a scope, or an admin who sees every team."""

    owner: str
    admin: bool
    scope: str = "write"
    token_id: uuid.UUID | None = None
    token_name: str | None = None  # the token's, when it was given one (chimes token create --name)

    @property
    def actor(self) -> str:
        """Who did it, as the job's history records it: the token's name, or its owner's."""
        return self.token_name or self.owner

    @property
    def owner_filter(self) -> str | None:
        """The owner to restrict reads and writes to; ``None`` for an admin."""
        return None if self.admin else self.owner

    @property
    def can_write(self) -> bool:
        return self.scope in ("write", "admin")


def hash_token(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


async def create_token(conn: asyncpg.Connection, owner: str, *, admin: bool = False, name: str | None = None,
                       scope: str | None = None) -> str:
    """Make a token and return it (the only time it exists in clear). ``admin=True`` is ``scope='admin'``."""
    scope = scope or ("admin" if admin else "write")
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}: expected one of {', '.join(SCOPES)}")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    await conn.execute(sql("insert_token"), uuid.uuid4(), hash_token(token), owner, scope, name)
    return token


async def authenticate(conn: asyncpg.Connection | asyncpg.Pool, token: str) -> Principal | None:
    """The principal of a valid, unrevoked token; None for anything else (never an error)."""
    if not token.startswith(TOKEN_PREFIX) or len(token) > 200 or not token.isascii():
        return None
    row = await conn.fetchrow(sql("token_by_hash"), hash_token(token))
    return None if row is None else Principal(row["owner"], row["admin"], row["scope"], row["token_id"],
                                                   row["name"])


@dataclass(frozen=True, slots=True)
class TokenInfo:
    """A token as ``chimes token list`` shows it: never its secret."""

    token_id: uuid.UUID
    owner: str
    admin: bool
    scope: str
    name: str | None
    created_at: datetime
    revoked_at: datetime | None


async def list_tokens(conn: asyncpg.Connection | asyncpg.Pool) -> list[TokenInfo]:
    """Every token, oldest first, revoked ones included."""
    return [TokenInfo(**dict(row)) for row in await conn.fetch(sql("list_tokens"))]


async def revoke_token(conn: asyncpg.Connection | asyncpg.Pool, token_id: uuid.UUID) -> bool:
    """Revoke an active token; False when there is none with that id."""
    return await conn.fetchval(sql("revoke_token"), token_id) is not None


async def create_first_admin_token(conn: asyncpg.Connection, name: str, *, allow_commands: bool = False) -> str | None:
    """An admin token (owner ``admin``) when there is no active admin token yet, else None. Processes
    starting together make one between them: the table is locked against concurrent inserts for the
    check. ``allow_commands``: the admin owner may also run command tasks."""
    async with conn.transaction():
        await conn.execute(sql("lock_api_tokens"))
        if await conn.fetchval(sql("count_admin_tokens")):
            return None
        token = await create_token(conn, "admin", admin=True, name=name)
        if allow_commands:
            await OwnerStore(conn).set("admin", allow_commands=True)
        return token
