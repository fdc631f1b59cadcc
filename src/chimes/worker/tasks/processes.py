"""Local processes for the task types that run one (command and container tasks).

Each gets its own session/process group so that the whole tree it spawns (shell pipelines,
background children) can be signalled at once: on timeout or cancellation nothing may outlive the
run, otherwise retries would pile up orphans.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys

from chimes.worker.tasks.common import OutputTail, TaskContext, rfc3339_utc

__all__ = [
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


def run_identity_env(ctx: TaskContext) -> dict[str, str]:
    """The ``CHIMES_*`` variables that tell a task which run (and attempt) it is."""
    return {
        "CHIMES_RUN_ID": ctx.run_id,
        "CHIMES_JOB_ID": ctx.job_id,
        "CHIMES_ATTEMPT": str(int(ctx.attempt)),
        "CHIMES_SCHEDULED_AT": rfc3339_utc(ctx.scheduled_at),
    }


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
