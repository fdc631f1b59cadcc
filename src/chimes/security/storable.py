"""Input that parses as JSON yet cannot be stored or sent: NUL characters (PostgreSQL text refuses
them), lone UTF-16 surrogates such as ``"\\ud800"`` (not Unicode: no UTF-8 encoder takes them) and
structures nested so deep that serialising them overflows. Refused at validation, naming the field,
instead of failing later with a server error."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel

#: Deepest nesting of a free-form value (an HTTP task's body); JSON APIs rarely go past ten.
MAX_DEPTH = 32
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def storable_problem(value: Any, depth: int = 0) -> str | None:
    """What makes ``value`` unstorable, or None. Nested models are checked by their own validators."""
    if isinstance(value, str):
        return _text_problem(value)
    if isinstance(value, BaseModel) or not isinstance(value, (dict, list, tuple)):
        return None
    if depth >= MAX_DEPTH:
        return f"is nested deeper than {MAX_DEPTH} levels"
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        problem = (_text_problem(key) if isinstance(key, str) else None) or storable_problem(item, depth + 1)
        if problem is not None:
            return problem
    return None


def _text_problem(text: str) -> str | None:
    if "\x00" in text:
        return "contains a NUL character"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "contains a lone surrogate (such as \\ud800), which is not valid Unicode"
    return None


def storable_text(text: str | None) -> str | None:
    """``text`` as PostgreSQL can keep it: NUL characters and lone surrogates replaced by U+FFFD.
    For what Chimes records rather than refuses (a task's output, an error message): a target that
    answers with a NUL byte must not make its outcome impossible to record."""
    if text is None or _text_problem(text) is None:
        return text
    return _UNSTORABLE.sub("\ufffd", text)
