"""JSON responses with RFC 3339 times (``Z`` for UTC) and UUIDs as strings, via orjson."""

from __future__ import annotations

import uuid
from typing import Any

import orjson
from starlette.responses import JSONResponse as _StarletteJSONResponse


def _fallback(value: Any) -> str:
    # asyncpg returns its own UUID subclass, which orjson does not take as a uuid.UUID.
    if isinstance(value, uuid.UUID):
        return str(value)
    raise TypeError(f"cannot serialize {type(value).__name__}")


def dumps(content: Any) -> bytes:
    return orjson.dumps(content, default=_fallback, option=orjson.OPT_UTC_Z | orjson.OPT_NON_STR_KEYS)


class JSONResponse(_StarletteJSONResponse):
    def render(self, content: Any) -> bytes:
        return dumps(content)
