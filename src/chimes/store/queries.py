"""The SQL Chimes runs, loaded once from ``sql/*.sql`` files of named blocks (``-- name: x``).

A block either numbers its parameters (``$1``, ``$2``: read with :func:`sql`) or names them
(``$job_id``, a lowercase identifier: read with :func:`query` or :func:`bind`), never both. Named
parameters are numbered at load in the order they first appear, and bound by name, so a parameter
added or removed cannot shift the ones after it. Text the server does not read as parameters is
left alone: comments, quoted strings and identifiers, and dollar-quoted strings (``$tag$...$tag$``).

A block may also hold fragments, ``{spec_columns}``, that the caller of :func:`query` supplies: a list
of columns declared once in Python, written into the statement from that declaration.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)

# Alternatives in the order that decides what a "$" is: inside a comment, a quoted string or
# identifier or a dollar-quoted string it is text; after a word character it belongs to an
# identifier (PostgreSQL allows "$" inside one).
_TOKEN = re.compile(
    r"""
      (?P<comment>--[^\n]*)
    | (?P<block>/\*.*?\*/)
    | (?P<string>'(?:[^']|'')*')
    | (?P<ident>"(?:[^"]|"")*")
    | (?P<dollar>\$(?P<tag>(?:[A-Za-z_][A-Za-z0-9_]*)?)\$.*?\$(?P=tag)\$)
    | (?<![\w$])\$(?P<number>\d+)
    | (?<![\w$])\$(?P<named>[A-Za-z_][A-Za-z0-9_]*)(?![\w$])
    | \{(?P<fragment>[a-z_][a-z0-9_]*)\}
    """,
    re.VERBOSE | re.DOTALL,
)
_LOWER = re.compile(r"[a-z_][a-z0-9_]*")
# unnest($a_x::t[], $a_y::t[]) AS alias(x, y): the arrays bound by name and the columns they become.
_UNNEST = re.compile(r"unnest\(((?:\s*\$[a-z_][a-z0-9_]*(?:::[\w ]+\[\])?\s*,?)+)\)\s+AS\s+\w+\(([\w\s,]+)\)",
                     re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Query:
    """A block with named parameters: ``text`` numbers them in the order of ``names``."""

    name: str
    text: str
    names: tuple[str, ...]

    def args(self, values: Mapping[str, Any]) -> list[Any]:
        """The arguments in the order of ``text``; every name must be given, and no other."""
        if len(values) != len(self.names) or not all(n in values for n in self.names):
            missing = [n for n in self.names if n not in values]
            unknown = sorted(set(values) - set(self.names))
            raise TypeError(f"query {self.name!r}: " + "; ".join(
                part for part in (f"missing {', '.join(missing)}" if missing else "",
                                  f"unknown {', '.join(unknown)}" if unknown else "") if part))
        return [values[n] for n in self.names]


def parse(name: str, body: str, fragments: Mapping[str, str] | None = None) -> str | Query:
    """The block's text as the server takes it: unchanged when it numbers its parameters (or has
    none), a :class:`Query` when it names them. ``fragments``: the text of each ``{fragment}``."""
    if fragments is not None or _fragments(body):
        body = _fill(name, body, fragments or {})
    names: dict[str, int] = {}
    numbered = False

    def number(match: re.Match[str]) -> str:
        nonlocal numbered
        if match["number"] is not None:
            numbered = True
        elif match["named"] is not None:
            param = match["named"]
            if not _LOWER.fullmatch(param):
                raise ValueError(f"query {name!r}: parameter ${param} is not a lowercase name")
            return f"${names.setdefault(param, len(names) + 1)}"
        return match[0]

    text = _TOKEN.sub(number, body)
    if not names:
        return body
    if numbered:
        raise ValueError(f"query {name!r} both numbers and names its parameters")
    _check_unnests(name, body)
    return Query(name, text, tuple(names))


def _fragments(body: str) -> set[str]:
    return {m["fragment"] for m in _TOKEN.finditer(body) if m["fragment"] is not None}


def _fill(name: str, body: str, fragments: Mapping[str, str]) -> str:
    missing = _fragments(body) - set(fragments)
    if missing:
        raise ValueError(f"query {name!r}: no text given for the fragments {', '.join(sorted(missing))}")
    return _TOKEN.sub(lambda m: fragments[m["fragment"]] if m["fragment"] is not None else m[0], body)


def _check_unnests(name: str, body: str) -> None:
    """Each array unnested by name becomes the column its name ends with, so that an array added
    to the list but not to the columns (or in another place) fails at load, not in a wrong row."""
    for match in _UNNEST.finditer(body):
        arrays = re.findall(r"\$([a-z_][a-z0-9_]*)", match[1])
        columns = [c.strip() for c in match[2].split(",")]
        if len(arrays) != len(columns) or not all(
                a == c or a.endswith(f"_{c}") for a, c in zip(arrays, columns, strict=False)):
            raise ValueError(f"query {name!r}: unnest of {', '.join(arrays)} does not match its columns "
                             f"{', '.join(columns)}")


@cache
def _blocks() -> dict[str, str]:
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


@cache
def _load() -> dict[str, str | Query]:
    """Every block that needs no fragments, parsed: a mistake in one fails the first query read."""
    return {name: parse(name, body) for name, body in _blocks().items() if not _fragments(body)}


@cache
def _with_fragments(name: str, fragments: tuple[tuple[str, str], ...]) -> str | Query:
    return parse(name, _blocks()[name], dict(fragments))


def sql(name: str, **fragments: str) -> str:
    """The text of the named query; a KeyError names a query that does not exist. A query that
    names its parameters is read with :func:`query` instead, which binds them. ``fragments``: the
    text of the block's ``{fragment}``s, such as identifiers quoted by the caller, which a statement
    cannot take as parameters (not cached: they change from call to call)."""
    block = parse(name, _blocks()[name], fragments) if fragments else _load().get(name) or _with_fragments(name, ())
    if isinstance(block, Query):
        raise TypeError(f"query {name!r} names its parameters: bind them with query() or bind()")
    return block


def query(name: str, **fragments: str) -> Query:
    """The named query whose parameters are named, with the text of its fragments; a KeyError names
    a query that does not exist."""
    block = _with_fragments(name, tuple(sorted(fragments.items()))) if fragments else _load().get(name)
    if block is None:
        block = _with_fragments(name, ())
    if not isinstance(block, Query):
        raise TypeError(f"query {name!r} numbers its parameters: read it with sql()")
    return block


def bind(name: str, /, **values: Any) -> tuple[str, list[Any]]:
    """The text of the named query and its arguments, given by name: ``conn.fetch(text, *args)``."""
    q = query(name)
    return q.text, q.args(values)
