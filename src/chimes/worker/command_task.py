"""Command tasks: run a local program and judge the run by its exit status.

Each command gets its own session/process group so that the whole tree it spawns
(shell pipelines, background children) can be signalled at once: on timeout or
cancellation nothing may outlive the run, otherwise retries would pile up orphans.
The process-group helpers are public because container tasks run their runtime CLI
the same way (:mod:`chimes.worker.container_task`).

A command gets no more of the worker's environment than a login would give it (:data:`BASE_ENV`):
the worker's holds the secret key, the database URL and whatever else its operator set, none of it
meant for a team's program. The task's own variables and the run identity come on top.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from typing import Any

from chimes.worker.executors import (
    OUTPUT_TAIL_BYTES,
    OutputTail,
    TaskContext,
    TaskOutcome,
    format_seconds,
    rfc3339_utc,
    short_error,
)

__all__ = [
    "BASE_ENV",
    "CommandExecutor",
    "build_env",
    "drain_output",
    "exit_error",
    "pump_output",
    "run_identity_env",
    "spawn_in_group",
    "stop_process_group",
]

_READ_CHUNK = 64 * 1024
#: How often the group is checked for survivors during the SIGTERM grace period.
_GROUP_POLL_SEC = 0.02
#: How long to wait for buffered output once the process group is gone.
_DRAIN_SEC = 1.0
#: The worker's variables a command inherits, when set (and every ``LC_*``): where programs are, who
#: and where the user is, language and time zone, where temporary files go. Nothing else.
BASE_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR")


def run_identity_env(ctx: TaskContext) -> dict[str, str]:
    """The ``CHIMES_*`` variables that tell a task which run (and attempt) it is."""
    return {
        "CHIMES_RUN_ID": ctx.run_id,
        "CHIMES_JOB_ID": ctx.job_id,
        "CHIMES_ATTEMPT": str(int(ctx.attempt)),
        "CHIMES_SCHEDULED_AT": rfc3339_utc(ctx.scheduled_at),
    }


def base_env() -> dict[str, str]:
    """The part of the worker's environment a command inherits (:data:`BASE_ENV`); PATH always."""
    env = {name: value for name, value in os.environ.items() if name in BASE_ENV or name.startswith("LC_")}
    env.setdefault("PATH", os.defpath)
    return env


def build_env(task_env: dict[str, Any] | None, ctx: TaskContext) -> dict[str, str]:
    """A minimal base (:func:`base_env`) + task env + run identity; ours win so scripts can trust them."""
    env = base_env()
    env.update({str(k): str(v) for k, v in (task_env or {}).items()})
    env.update(run_identity_env(ctx))
    return env


async def spawn_in_group(argv: list[str], env: dict[str, str] | None = None,
                         cwd: str | None = None) -> asyncio.subprocess.Process:
    """Start ``argv`` as the leader of a new process group, stdout and stderr merged into one pipe."""
    return await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is still in group ``pgid``.

    ``killpg(pgid, 0)`` also counts zombies, and reparented zombies linger for a
    while (or forever under an init that does not reap), so on Linux /proc is
    consulted to avoid waiting out the full grace period for the already dead.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not sys.platform.startswith("linux"):
        return True
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:  # exited while scanning
            continue
        # "pid (comm) state ppid pgrp ..."; comm may contain spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def exit_error(returncode: int) -> str:
    """``exit code N``, or the signal name for a process killed by a signal."""
    if returncode < 0:
        try:
            return f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class CommandExecutor:
    """Runs ``{"type": "command"}`` tasks as subprocesses in their own process group."""

    def __init__(self, *, kill_grace_sec: float = 5.0) -> None:
        self._kill_grace_sec = kill_grace_sec

    async def run(self, task: dict[str, Any], ctx: TaskContext) -> TaskOutcome:
        """Run the command to completion or timeout; never raises except on cancellation."""
        argv = [str(arg) for arg in task.get("argv") or ()]
        if not argv:
            return TaskOutcome(False, "empty argv")
        cwd = task.get("cwd")
        try:
            proc = await spawn_in_group(argv, build_env(task.get("env"), ctx), cwd)
        except FileNotFoundError as exc:
            if cwd is not None and exc.filename == cwd:
                return TaskOutcome(False, short_error(f"working directory not found: {cwd}"))
            return TaskOutcome(False, short_error(f"command not found: {argv[0]}"))
        except PermissionError:
            return TaskOutcome(False, short_error(f"permission denied: {argv[0]}"))
        except (OSError, ValueError) as exc:
            return TaskOutcome(False, short_error(f"cannot start command: {type(exc).__name__}: {exc}"))
        return await self._supervise(proc, ctx)

    async def _supervise(self, proc: asyncio.subprocess.Process, ctx: TaskContext) -> TaskOutcome:
        """Stream output into a bounded tail until exit, stopping the group on timeout/cancel."""
        tail = OutputTail(OUTPUT_TAIL_BYTES)
        try:
            async with asyncio.timeout(ctx.timeout_sec):
                await pump_output(proc, tail)
                returncode = await proc.wait()
        except TimeoutError:
            await stop_process_group(proc, self._kill_grace_sec)
            await drain_output(proc, tail)
            return TaskOutcome(False, f"timed out after {format_seconds(ctx.timeout_sec)}s", tail.text())
        except BaseException:  # cancellation (or anything unexpected): leave no process behind
            await stop_process_group(proc, self._kill_grace_sec)
            await drain_output(proc, tail)
            raise
        if returncode == 0:
            return TaskOutcome(True, None, tail.text())
        return TaskOutcome(False, exit_error(returncode), tail.text())


async def pump_output(proc: asyncio.subprocess.Process, tail: OutputTail) -> None:
    """Feed everything ``proc`` writes into ``tail`` until its pipe reaches EOF."""
    assert proc.stdout is not None
    while chunk := await proc.stdout.read(_READ_CHUNK):
        tail.feed(chunk)


async def drain_output(proc: asyncio.subprocess.Process, tail: OutputTail) -> None:
    """Collect output still buffered after the group died; reaching EOF also closes the pipe transport."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(_DRAIN_SEC):
            await pump_output(proc, tail)


async def stop_process_group(proc: asyncio.subprocess.Process, grace_sec: float) -> None:
    """SIGTERM the whole group of ``proc``, allow ``grace_sec``, then SIGKILL whatever is left.

    SIGKILL is sent from ``finally`` so that even a second cancellation arriving
    during the grace period cannot leave the group running.
    """
    pgid = proc.pid  # start_new_session: the child is its group's leader
    _signal_group(pgid, signal.SIGTERM)
    try:
        async with asyncio.timeout(grace_sec):
            await proc.wait()
            while _group_alive(pgid):  # noqa: ASYNC110 - nothing signals a group's end; poll
                await asyncio.sleep(_GROUP_POLL_SEC)
    except TimeoutError:
        pass
    finally:
        _signal_group(pgid, signal.SIGKILL)
    await proc.wait()
