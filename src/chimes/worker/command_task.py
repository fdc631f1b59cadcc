"""Command tasks: run a local program and judge the run by its exit status.

Each command gets its own session/process group so that the whole tree it spawns
(shell pipelines, background children) can be signalled at once: on timeout or
cancellation nothing may outlive the run, otherwise retries would pile up orphans.
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

__all__ = ["CommandExecutor", "build_env"]

_READ_CHUNK = 64 * 1024
#: How often the group is checked for survivors during the SIGTERM grace period.
_GROUP_POLL_SEC = 0.02
#: How long to wait for buffered output once the process group is gone.
_DRAIN_SEC = 1.0


def build_env(task_env: dict[str, Any] | None, ctx: TaskContext) -> dict[str, str]:
    """Worker environment + task env + run identity; ours win so scripts can trust them."""
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in (task_env or {}).items()})
    env["CHIMES_RUN_ID"] = ctx.run_id
    env["CHIMES_JOB_ID"] = ctx.job_id
    env["CHIMES_ATTEMPT"] = str(int(ctx.attempt))
    env["CHIMES_SCHEDULED_AT"] = rfc3339_utc(ctx.scheduled_at)
    return env


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


def _exit_error(returncode: int) -> str:
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
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=build_env(task.get("env"), ctx),
                cwd=cwd,
                start_new_session=True,
            )
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
                await self._pump(proc, tail)
                returncode = await proc.wait()
        except TimeoutError:
            await self._stop_group(proc)
            await self._drain(proc, tail)
            return TaskOutcome(False, f"timed out after {format_seconds(ctx.timeout_sec)}s", tail.text())
        except BaseException:  # cancellation (or anything unexpected): leave no process behind
            await self._stop_group(proc)
            await self._drain(proc, tail)
            raise
        if returncode == 0:
            return TaskOutcome(True, None, tail.text())
        return TaskOutcome(False, _exit_error(returncode), tail.text())

    @staticmethod
    async def _pump(proc: asyncio.subprocess.Process, tail: OutputTail) -> None:
        assert proc.stdout is not None
        while chunk := await proc.stdout.read(_READ_CHUNK):
            tail.feed(chunk)

    async def _drain(self, proc: asyncio.subprocess.Process, tail: OutputTail) -> None:
        """Collect output still buffered after the group died; reaching EOF also closes the pipe transport."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_DRAIN_SEC):
                await self._pump(proc, tail)

    async def _stop_group(self, proc: asyncio.subprocess.Process) -> None:
        """SIGTERM the whole group, allow the grace period, then SIGKILL whatever is left.

        SIGKILL is sent from ``finally`` so that even a second cancellation arriving
        during the grace period cannot leave the group running.
        """
        pgid = proc.pid  # start_new_session: the child is its group's leader
        _signal_group(pgid, signal.SIGTERM)
        try:
            async with asyncio.timeout(self._kill_grace_sec):
                await proc.wait()
                while _group_alive(pgid):  # noqa: ASYNC110 - nothing signals a group's end; poll
                    await asyncio.sleep(_GROUP_POLL_SEC)
        except TimeoutError:
            pass
        finally:
            _signal_group(pgid, signal.SIGKILL)
        await proc.wait()
