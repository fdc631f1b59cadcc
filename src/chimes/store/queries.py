"""The SQL Chimes runs, loaded once from ``sql/*.sql`` files of named blocks (``-- name: x``)."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)


@cache
def _load() -> dict[str, str]:
    blocks: dict[str, str] = {}
    for entry in (resources.files("chimes.store") / "sql").iterdir():
        if not entry.name.endswith(".sql"):
            continue
        parts = _NAME.split(entry.read_text())
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in blocks:
                raise ValueError(f"query {name!r} is defined twice")
            blocks[name] = body.strip().rstrip(";")
    return blocks


def sql(name: str) -> str:
    """The text of the named query; a KeyError names a query that does not exist."""
    return _load()[name]
