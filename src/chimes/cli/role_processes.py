"""``chimes up``'s scheduler and worker as child processes of its own, supervised by it.

One Python process runs its Python on one core at a time; the API, the firing and the calls in one
process share that core, and a burst of runs waits on it. ``chimes up`` keeps the API (and the
embedded PostgreSQL) in the process you started, and runs ``chimes scheduler`` and ``chimes worker``
as its children, so that the roles can run on several cores at once.

The children are the same commands an operator runs on their own, configured the way ``chimes up``
was: each option they share with ``up`` is handed on through its ``CHIMES_*`` variable (never on the
command line, where ``ps`` would show the database URL and its password).

Supervision: SIGTERM or SIGINT to ``chimes up`` is passed on to the children as SIGTERM; the parent
waits for them (the worker's shutdown grace, then SIGKILL) before it stops the embedded PostgreSQL.
A child that exits on its own is not restarted: it stops ``chimes up`` as a whole, with a line naming
the role, its pid and its exit status, and ``chimes up`` exits 1, so that whoever started it (a
terminal, systemd, a container runtime) sees the failure rather than a half-running Chimes. Should
the parent be killed outright (SIGKILL), the kernel sends each child SIGTERM (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import click

log = logging.getLogger("chimes")

_PR_SET_PDEATHSIG = 1
# Variables of the roles' own options that ``up`` has no option for: inherited from the parent's
# environment they would make every child, say, try to listen on the same metrics port.
_NOT_HANDED_ON = ("CHIMES_METRICS_PORT", "CHIMES_METRICS_HOST", "CHIMES_NODE_ID", "CHIMES_WORKER_ID")


@dataclass(frozen=True, slots=True)
class RoleCommand:
    role: str  # the subcommand: "scheduler" or "worker"
    env: Mapping[str, str]
    name: str = ""  # in logs and messages: the role, numbered when there are several workers

    @property
    def label(self) -> str:
        return self.name or self.role


def role_commands(root: click.Context, up_params: Mapping[str, Any], dsn: str,
                  worker_processes: int = 1) -> list[RoleCommand]:
    """The children of ``chimes up``: a scheduler and ``worker_processes`` workers, each given ``up``'s
    settings that its own command has an option for (``--worker-concurrency`` is the workers'
    ``--concurrency``, shared out among them: it stays the most runs executed at once)."""
    group = root.command
    assert isinstance(group, click.Group)
    shared = {"CHIMES_DATABASE_URL": dsn} | _variables(root.command, root.params)
    commands = [RoleCommand("scheduler", shared | _variables(group.commands["scheduler"], up_params))]
    total = int(up_params["worker_concurrency"])
    for n in range(worker_processes):
        values = dict(up_params, concurrency=total // worker_processes + (n < total % worker_processes))
        name = "worker" if worker_processes == 1 else f"worker {n + 1}"
        commands.append(RoleCommand("worker", shared | _variables(group.commands["worker"], values), name))
    return commands


def _variables(command: click.Command, values: Mapping[str, Any]) -> dict[str, str]:
    """The ``CHIMES_*`` variables that give ``command`` these option values."""
    found = {}
    for param in command.params:
        if not isinstance(param, click.Option) or param.name not in values or not isinstance(param.envvar, str):
            continue
        value = values[param.name]
        if value is None:
            continue
        if isinstance(value, bool):
            found[param.envvar] = "true" if value else "false"
        elif isinstance(value, tuple | list):
            found[param.envvar] = ",".join(map(str, value))  # the roles read a variable as a comma list
        else:
            found[param.envvar] = str(value)
    return found


def _parent_death_signal() -> Callable[[], None] | None:
    """What a child runs between fork and exec so that the kernel sends it SIGTERM when ``chimes up``
    dies; None off Linux. libc's prctl is looked up here, in the parent: a lookup (dlopen) in a child
    forked while another thread held its lock would never return."""
    if sys.platform != "linux":
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def die_with_parent() -> None:  # pragma: no cover - runs in the child
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the signal was asked for
            os._exit(1)

    return die_with_parent


class RoleProcesses:
    """The children of ``chimes up``: started together, stopped together."""

    def __init__(self, commands: list[RoleCommand], stop_wait_sec: float) -> None:
        self._commands = commands
        self._stop_wait_sec = stop_wait_sec
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.stopping = False

    async def start(self) -> None:
        base = {k: v for k, v in os.environ.items() if k not in _NOT_HANDED_ON}
        die_with_parent = _parent_death_signal()
        try:
            for command in self._commands:
                # stdin closed; stdout and stderr are the parent's: one stream of log lines.
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "chimes", command.role, env=base | dict(command.env),
                    stdin=asyncio.subprocess.DEVNULL, preexec_fn=die_with_parent)
                self.procs[command.label] = proc
                log.info("started the %s process (pid %d)", command.label, proc.pid)
        except BaseException:
            self.stop()
            await self.wait()
            raise

    async def first_exit(self) -> tuple[str, int, int]:
        """Wait until a child exits: its role, pid and exit status (negative: the signal that ended it)."""
        waits = {asyncio.ensure_future(proc.wait()): role for role, proc in self.procs.items()}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        role = waits[next(iter(done))]
        proc = self.procs[role]
        assert proc.returncode is not None
        return role, proc.pid, proc.returncode

    def stop(self) -> None:
        """SIGTERM to every child still running; idempotent."""
        self.stopping = True
        for proc in self.procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)

    async def wait(self) -> None:
        """Until every child has exited: those still running after the stop wait are killed."""
        for role, proc in self.procs.items():
            try:
                await asyncio.wait_for(proc.wait(), timeout=self._stop_wait_sec)
            except TimeoutError:
                log.error("the %s process (pid %d) did not stop within %.0f s: killed", role, proc.pid,
                          self._stop_wait_sec)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()


def describe_exit(status: int) -> str:
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-status).name}"
        return f"was killed by signal {-status}"
    return f"exited with status {status}"
