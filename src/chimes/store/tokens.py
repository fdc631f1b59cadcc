"""API tokens: random secrets shown once, stored only as SHA-256 hashes."""

from __future__ import annotations

import hashlib
import secrets
import uuid
from dataclasses import dataclass

import asyncpg

from chimes.store.queries import sql

TOKEN_PREFIX = "chm_"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a team (owner), or an admin who sees every team."""

    owner: str
    admin: bool

    @property
    def owner_filter(self) -> str | None:
        """The owner to restrict reads and writes to; ``None`` for an admin."""
        return None if self.admin else self.owner


def hash_token(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


async def create_token(conn: asyncpg.Connection, owner: str, *, admin: bool = False, name: str | None = None) -> str:
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    await conn.execute(sql("insert_token"), uuid.uuid4(), hash_token(token), owner, admin, name)
    return token


async def authenticate(conn: asyncpg.Connection | asyncpg.Pool, token: str) -> Principal | None:
    if not token.startswith(TOKEN_PREFIX) or len(token) > 200:
        return None
    row = await conn.fetchrow(sql("token_by_hash"), hash_token(token))
    return None if row is None else Principal(row["owner"], row["admin"])
