"""Which headers a task may set on its request, and which characters a header value may hold.

A task that sets the message framing (``Content-Length``, ``Transfer-Encoding``) or the connection's
own headers (``Connection``, ``Keep-Alive``, ``Upgrade``, ...) decides where its request ends on a
kept-alive connection: a ``Transfer-Encoding: chunked`` beside the client's ``Content-Length`` let a
crafted body swallow the next request sent on that connection, another team's, secret headers and
all (request smuggling). The HTTP client sets these itself; a task never does.

The ``X-Chimes-*`` names are Chimes' own: the run's identity, its signature and lease token, which
a target trusts because a task cannot set them. The worker always sent its own in their place, so a
task's ``X-Chimes-*`` header was accepted and never sent; the API refuses it instead.

The API refuses all of these (chimes.jobs.HttpTaskSpec) and the worker drops them again when it
sends (chimes.worker.tasks.http), for rows written before the rule or around the API.
"""

from __future__ import annotations

import re

#: Framing, hop-by-hop and routing headers; ``Proxy-*`` names are refused by prefix as well.
FORBIDDEN_HEADERS = frozenset({
    "content-length", "transfer-encoding", "connection", "keep-alive", "te", "trailer", "upgrade", "expect",
    "host",
})
FORBIDDEN_PREFIXES = ("proxy-",)
#: The names Chimes sets on every call (X-Chimes-Run-Id, X-Chimes-Signature, ...), by prefix.
RESERVED_PREFIX = "x-chimes-"
#: What a header name may be: an RFC 9110 token. The API refuses any other name (chimes.jobs), and the
#: worker fails a run whose stored name is not one (chimes.worker.tasks.http) rather than send it.
HEADER_NAME = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_HEADER_NAME = re.compile(HEADER_NAME)
_REFUSED_CHARACTER = re.compile("[^\t\x20-\x7e]")  # as header_value_problem's loop below


def forbidden_header(name: str) -> bool:
    """Whether a task may not set header ``name`` (case-insensitive)."""
    lowered = name.strip().lower()
    return lowered in FORBIDDEN_HEADERS or lowered.startswith(FORBIDDEN_PREFIXES)


def reserved_header(name: str) -> bool:
    """Whether ``name`` is one of Chimes' own (``X-Chimes-*``, case-insensitive)."""
    return name.strip().lower().startswith(RESERVED_PREFIX)


def is_header_name(name: str) -> bool:
    """Whether ``name`` is a token, as a header name must be."""
    return _HEADER_NAME.fullmatch(name) is not None


def header_value_problem(value: str) -> str | None:
    """Why ``value`` cannot be a header value, or None. Tab is allowed (RFC 9110 field content);
    every other C0 control character and DEL is refused: line breaks and NUL inject headers, and the
    others (``\\x0b``, ``\\x1f``) are refused by HTTP clients at send time, which would fail every run.
    So is every character beyond ASCII: the client sends header values as ASCII, and one that is not
    failed every attempt of its task (encode such text, for example percent-encoded or in base64)."""
    if _REFUSED_CHARACTER.search(value) is None:  # the common case, without a loop over the characters
        return None
    for ch in value:
        if ch in "\r\n":
            return "contains a line break"
        if ch == "\x00":
            return "contains a NUL character"
        if (ch < " " and ch != "\t") or ch == "\x7f":
            return f"contains the control character {ch!r}"
        if ch > "\x7f":
            return (f"contains the non-ASCII character {ch!r}: header values are ASCII (percent-encode or "
                    "base64 other text)")
    return None
