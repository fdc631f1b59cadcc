"""API tokens: random secrets shown once, stored only as SHA-256 hashes, each with an owner and a scope."""

from __future__ import annotations

import hashlib
import secrets
import uuid
from dataclasses import dataclass

import asyncpg

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
    return None if row is None else Principal(row["owner"], row["admin"], row["scope"], row["token_id"])
