"""What every task type shares: the run's context going in, its :class:`Outcome` coming out, and a
bounded tail of its output.

A task executor never raises for a task's failure (a broken webhook or a crashing command is an
ordinary outcome to record); only ``asyncio.CancelledError`` propagates, so that shutdown and run
cancellation keep working. This module imports no executor: each executor imports it.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime
from typing import NamedTuple

from chimes.enums import RunStatus

__all__ = [
    "MAX_ERROR_CHARS",
    "OUTPUT_TAIL_BYTES",
    "Outcome",
    "OutputTail",
    "TaskContext",
    "format_seconds",
    "rfc3339_utc",
    "short_error",
]

#: Most characters of task output kept in an outcome; run history stores it, so it must stay small.
OUTPUT_TAIL_BYTES = 4096
#: Longest error message kept, so a pathological exception text cannot bloat run history.
MAX_ERROR_CHARS = 1000
#: Worst-case UTF-8 width; the byte window must hold this many bytes per kept character.
_MAX_UTF8_WIDTH = 4


class TaskContext(NamedTuple):
    """Identity and limits of one run, passed to the task so it can dedupe and correlate. A named
    tuple, made per run: cheaper to make than a frozen dataclass."""

    run_id: str
    job_id: str
    attempt: int
    scheduled_at: datetime  # aware, UTC
    timeout_sec: float
    signing_secret: str | None = None  # the owner's: HTTP requests are signed with it (security/signing.py)
    lease_token: str | None = None  # lets an asynchronous target report for itself (callbacks)
    owner: str = ""  # whose run: HTTP connections are never shared between owners (worker/tasks/http.py)


class Outcome(NamedTuple):
    """How one attempt of a run ended: what an executor returns, and what the worker records.

    ``status`` is ``succeeded``, ``failed`` or ``cancelled``; or ``running`` when the target accepted
    the run and reports its outcome itself (HTTP 202 to a task with callbacks): the run stays running
    under its lease, which the target extends through the callback endpoints. A named tuple: a run
    makes two, and a frozen dataclass sets each field through ``object.__setattr__``.
    """

    status: RunStatus
    error: str | None = None
    output: str | None = None

    @classmethod
    def success(cls, output: str | None = None) -> Outcome:
        return cls(RunStatus.SUCCEEDED, None, output)

    @classmethod
    def failure(cls, error: str, output: str | None = None) -> Outcome:
        return cls(RunStatus.FAILED, error, output)

    @classmethod
    def accepted(cls, output: str | None = None) -> Outcome:
        """The target took the run and will report for itself (see the class docstring)."""
        return cls(RunStatus.RUNNING, None, output)

    @property
    def succeeded(self) -> bool:
        return self.status is RunStatus.SUCCEEDED

    @property
    def pending(self) -> bool:
        """Whether the target reports this run's outcome itself, later."""
        return self.status is RunStatus.RUNNING


@functools.lru_cache(maxsize=1024)  # the runs of a burst, or of a cron minute, share one due instant
def rfc3339_utc(moment: datetime) -> str:
    """Format ``moment`` as RFC 3339 in UTC with ``Z`` (milliseconds only when nonzero).

    Receivers parse this from headers/env vars, so it must be unambiguous and
    compact; naive datetimes are taken to be UTC, which is what the store uses.
    """
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    moment = moment.astimezone(UTC)
    text = moment.strftime("%Y-%m-%dT%H:%M:%S")
    millis = moment.microsecond // 1000
    if millis:
        text += f".{millis:03d}"
    return text + "Z"


def format_seconds(seconds: float) -> str:
    """Render a duration for error messages: ``5`` rather than ``5.0``, ``0.5`` stays."""
    return f"{seconds:g}"


def short_error(text: str) -> str:
    """Cap an error message so run history rows stay small."""
    if len(text) <= MAX_ERROR_CHARS:
        return text
    return text[: MAX_ERROR_CHARS - 3] + "..."


class OutputTail:
    """Bounded rolling window over a byte stream, keeping only its end.

    Task output can be unbounded (a chatty command, a huge response), but only the
    last :data:`OUTPUT_TAIL_BYTES` characters are ever stored, so memory stays
    constant no matter how much is fed in.
    """

    def __init__(self, max_chars: int = OUTPUT_TAIL_BYTES) -> None:
        self._max_chars = max_chars
        self._max_bytes = max_chars * _MAX_UTF8_WIDTH
        self._buf = bytearray()
        self._trimmed = False
        self.total_bytes = 0

    def feed(self, data: bytes) -> None:
        """Append ``data``, discarding whatever falls out of the window."""
        self.total_bytes += len(data)
        self._buf += data
        excess = len(self._buf) - self._max_bytes
        if excess > 0:
            del self._buf[:excess]
            self._trimmed = True

    def text(self, encoding: str = "utf-8") -> str | None:
        """Decode the window (invalid bytes replaced); ``None`` when nothing was output."""
        data = bytes(self._buf)
        if self._trimmed:
            # The cut may have split a multi-byte character: drop its orphaned continuation bytes.
            skip = 0
            while skip < min(len(data), _MAX_UTF8_WIDTH - 1) and data[skip] & 0xC0 == 0x80:
                skip += 1
            data = data[skip:]
        if not data:
            return None
        try:
            decoded = data.decode(encoding, errors="replace")
        except LookupError:  # unknown charset announced by a server
            decoded = data.decode("utf-8", errors="replace")
        return decoded[-self._max_chars :]
