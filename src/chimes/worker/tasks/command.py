"""Command tasks: run a local program and judge the run by its exit status.

The program runs in its own process group (:mod:`chimes.worker.tasks.processes`), so that nothing
it spawns outlives the run.

A command gets no more of the worker's environment than a login would give it (:data:`BASE_ENV`):
the worker's holds the secret key, the database URL and whatever else its operator set, none of it
meant for a team's program. The task's own variables and the run identity come on top.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from chimes.settings import KILL_GRACE_SEC
from chimes.worker.tasks.common import OUTPUT_TAIL_BYTES, Outcome, OutputTail, TaskContext, format_seconds, short_error
from chimes.worker.tasks.processes import (
    drain_output,
    exit_error,
    pump_output,
    run_identity_env,
    spawn_in_group,
    stop_process_group,
)

__all__ = ["BASE_ENV", "CommandExecutor", "base_env", "build_env"]

#: The worker's variables a command inherits, when set (and every ``LC_*``): where programs are, who
#: and where the user is, language and time zone, where temporary files go. Nothing else.
BASE_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR")


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


class CommandExecutor:
    """Runs ``{"type": "command"}`` tasks as subprocesses in their own process group."""

    def __init__(self, *, kill_grace_sec: float = KILL_GRACE_SEC) -> None:
        self._kill_grace_sec = kill_grace_sec

    async def run(self, task: dict[str, Any], ctx: TaskContext) -> Outcome:
        """Run the command to completion or timeout; never raises except on cancellation."""
        argv = [str(arg) for arg in task.get("argv") or ()]
        if not argv:
            return Outcome.failure("empty argv")
        cwd = task.get("cwd")
        try:
            proc = await spawn_in_group(argv, build_env(task.get("env"), ctx), cwd)
        except FileNotFoundError as exc:
            if cwd is not None and exc.filename == cwd:
                return Outcome.failure(short_error(f"working directory not found: {cwd}"))
            return Outcome.failure(short_error(f"command not found: {argv[0]}"))
        except PermissionError:
            return Outcome.failure(short_error(f"permission denied: {argv[0]}"))
        except (OSError, ValueError) as exc:
            return Outcome.failure(short_error(f"cannot start command: {type(exc).__name__}: {exc}"))
        return await self._supervise(proc, ctx)

    async def _supervise(self, proc: asyncio.subprocess.Process, ctx: TaskContext) -> Outcome:
        """Stream output into a bounded tail until exit, stopping the group on timeout/cancel."""
        tail = OutputTail(OUTPUT_TAIL_BYTES)
        try:
            async with asyncio.timeout(ctx.timeout_sec):
                await pump_output(proc, tail)
                returncode = await proc.wait()
        except TimeoutError:
            await stop_process_group(proc, self._kill_grace_sec)
            await drain_output(proc, tail)
            return Outcome.failure(f"timed out after {format_seconds(ctx.timeout_sec)}s", tail.text())
        except BaseException:  # cancellation (or anything unexpected): leave no process behind
            await stop_process_group(proc, self._kill_grace_sec)
            await drain_output(proc, tail)
            raise
        if returncode == 0:
            return Outcome.success(tail.text())
        return Outcome.failure(exit_error(returncode), tail.text())
