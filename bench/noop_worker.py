"""``python -m bench.noop_worker [chimes worker options]``: a real ``chimes worker`` for the **noop**
task of ``python -m bench peers`` (bench/task_client.py).

Chimes has no task type that does nothing, and a command task (``true``) would cost a process per
run, which no peer's no-op pays. So this is ``chimes worker`` itself, its command line, claims,
guard, outcome buffer and flushes unchanged, with one change: an HTTP task to a URL ending in
:data:`~bench.task_client.NOOP_PATH` ends at once as succeeded, without a call. Any other task goes
to the real executors, so a job that is not a no-op one reaches the target, and the benchmark, which
expects no call at all in this variant, says so.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable
from typing import Any

from bench.task_client import NOOP_PATH
from chimes.worker.tasks import dispatch
from chimes.worker.tasks.common import Outcome, TaskContext

_SUCCEEDED = Outcome.success()


async def _succeeded() -> Outcome:
    return _SUCCEEDED


class NoopExecutors(dispatch.Executors):
    """The worker's executors, but for the no-op task: the coroutine is still made and awaited by the
    worker, as every executor's is."""

    def run(self, task: dict[str, Any], ctx: TaskContext) -> Awaitable[Outcome]:
        if isinstance(task, dict) and task.get("type") == "http" and str(task.get("url", "")).endswith(NOOP_PATH):
            return _succeeded()
        return super().run(task, ctx)


def main(argv: list[str]) -> None:
    from chimes.cli.main import cli

    # `chimes worker` makes its executors from this name when it starts (chimes.cli.main.worker).
    dispatch.Executors = NoopExecutors  # type: ignore[misc]
    cli(["worker", *argv], prog_name="chimes")


if __name__ == "__main__":
    main(sys.argv[1:])
