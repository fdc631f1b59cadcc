"""Task execution for workers: the shared value types and the dispatcher.

The worker loop only talks to :class:`Executors`; it hands over a validated task
spec plus a :class:`TaskContext` and always gets a :class:`TaskOutcome` back.
Executors never raise for task failures (a broken webhook or a crashing command is
an ordinary outcome to record), only ``asyncio.CancelledError`` propagates so that
shutdown and run cancellation keep working.

The concrete executors live in :mod:`chimes.worker.http_task`,
:mod:`chimes.worker.command_task` and :mod:`chimes.worker.container_task`; they
import the types from here, so this module imports them lazily (and re-exports
them through ``__getattr__``) to avoid an import cycle whichever module is imported first.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chimes.security.ssrf import EgressPolicy
    from chimes.worker.command_task import CommandExecutor
    from chimes.worker.container_task import ContainerExecutor
    from chimes.worker.http_task import HttpExecutor

__all__ = [
    "OUTPUT_TAIL_BYTES",
    "CommandExecutor",
    "Executors",
    "HttpExecutor",
    "OutputTail",
    "TaskContext",
    "TaskOutcome",
    "format_seconds",
    "rfc3339_utc",
]

#: Most characters of task output kept in an outcome; run history stores it, so it must stay small.
OUTPUT_TAIL_BYTES = 4096
#: Longest error message kept, so a pathological exception text cannot bloat run history.
MAX_ERROR_CHARS = 1000
#: Worst-case UTF-8 width; the byte window must hold this many bytes per kept character.
_MAX_UTF8_WIDTH = 4


@dataclass(frozen=True, slots=True)
class TaskContext:
    """Identity and limits of one run, passed to the task so it can dedupe and correlate."""

    run_id: str
    job_id: str
    attempt: int
    scheduled_at: datetime  # aware, UTC
    timeout_sec: float
    signing_secret: str | None = None  # the owner's: HTTP requests are signed with it (security/signing.py)
    lease_token: str | None = None  # lets an asynchronous target report for itself (callbacks)
    owner: str = ""  # whose run: HTTP connections are never shared between owners (worker/http_task.py)


@dataclass(frozen=True, slots=True)
class TaskOutcome:
    """Result of one task execution, as stored in run history."""

    succeeded: bool
    error: str | None = None
    output: str | None = None
    # The target accepted the run and will report its outcome itself (HTTP 202): the run stays
    # running under its lease, which the target extends through the callback endpoints.
    pending: bool = False


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


class Executors:
    """Dispatches a task spec to the executor for its ``type``.

    One instance per worker: it owns the pooled HTTP session, so ``close()`` must be
    awaited on shutdown.
    """

    def __init__(self, *, max_connections: int = 1000, kill_grace_sec: float = 5.0,
                 container_runtime: str = "docker", egress: EgressPolicy | None = None) -> None:
        from chimes.worker.command_task import CommandExecutor
        from chimes.worker.container_task import ContainerExecutor
        from chimes.worker.http_task import HttpExecutor

        self.http: HttpExecutor = HttpExecutor(max_connections=max_connections, egress=egress)
        self.command: CommandExecutor = CommandExecutor(kill_grace_sec=kill_grace_sec)
        self.container: ContainerExecutor = ContainerExecutor(container_runtime, kill_grace_sec=kill_grace_sec)

    async def run(self, task: dict[str, Any], ctx: TaskContext) -> TaskOutcome:
        """Execute ``task``; always returns an outcome unless cancelled."""
        task_type = task.get("type") if isinstance(task, dict) else None
        try:
            if task_type == "http":
                return await self.http.run(task, ctx)
            if task_type == "command":
                return await self.command.run(task, ctx)
            if task_type == "container":
                return await self.container.run(task, ctx)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # defensive: an executor bug must not kill the worker loop
            return TaskOutcome(False, short_error(f"internal error: {type(exc).__name__}: {exc}"))
        return TaskOutcome(False, f"unsupported task type {task_type!r}")

    async def close(self) -> None:
        """Release pooled connections; call once when the worker stops."""
        await self.http.close()


def __getattr__(name: str) -> Any:
    """Lazily re-export the concrete executors (they import this module, see module docstring)."""
    if name == "HttpExecutor":
        from chimes.worker.http_task import HttpExecutor

        return HttpExecutor
    if name == "CommandExecutor":
        from chimes.worker.command_task import CommandExecutor

        return CommandExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
