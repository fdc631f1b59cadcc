"""The dispatcher the worker loop talks to: it hands over a validated task spec and a
:class:`~chimes.worker.tasks.common.TaskContext`, and always gets an
:class:`~chimes.worker.tasks.common.Outcome` back (only cancellation propagates): each executor
turns its own failures into one, and the worker any bug that escapes it (``Worker._execute``).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from chimes.security.ssrf import EgressPolicy
from chimes.settings import CONTAINER_RUNTIME, KILL_GRACE_SEC
from chimes.worker.tasks.command import CommandExecutor
from chimes.worker.tasks.common import Outcome, TaskContext
from chimes.worker.tasks.container import ContainerExecutor
from chimes.worker.tasks.http import HttpExecutor

__all__ = ["Executors"]


class Executors:
    """Dispatches a task spec to the executor for its ``type``.

    One instance per worker: it owns the pooled HTTP sessions, so ``close()`` must be awaited on
    shutdown.
    """

    def __init__(self, *, max_connections: int = 1000, kill_grace_sec: float = KILL_GRACE_SEC,
                 container_runtime: str = CONTAINER_RUNTIME, egress: EgressPolicy | None = None) -> None:
        self.http = HttpExecutor(max_connections=max_connections, egress=egress)
        self.command = CommandExecutor(kill_grace_sec=kill_grace_sec)
        self.container = ContainerExecutor(container_runtime, kill_grace_sec=kill_grace_sec)

    def run(self, task: dict[str, Any], ctx: TaskContext) -> Awaitable[Outcome]:
        """Execute ``task``: the executor's own coroutine, handed back rather than awaited here (one
        frame less per run), which always gives an outcome unless cancelled."""
        task_type = task.get("type") if isinstance(task, dict) else None
        if task_type == "http":
            return self.http.run(task, ctx)
        if task_type == "command":
            return self.command.run(task, ctx)
        if task_type == "container":
            return self.container.run(task, ctx)
        return _unsupported(task_type)

    async def close(self) -> None:
        """Release pooled connections; call once when the worker stops."""
        await self.http.close()


async def _unsupported(task_type: object) -> Outcome:
    return Outcome.failure(f"unsupported task type {task_type!r}")
