"""The two tasks every system of ``python -m bench peers`` runs, the same for each.

- **http**: one POST to the target's one URL (:data:`CALL_PATH`), carrying the key header
  (:data:`KEY_HEADER`), made by Chimes' worker's own HTTP client, :class:`~chimes.worker.tasks.http.HttpExecutor`,
  in every system: Chimes' worker runs it for its HTTP task, and each peer's worker process holds one
  :class:`TaskClient` (one pool of kept-alive connections, as a worker has) that its task bodies call.
  So the call costs every system the same: the same headers (the run id, the signature, the trace
  context), the same connection handling, the same reply parsing.
- **noop**: nothing; the task body returns at once. What is left is the queue's and the scheduler's
  own cost. Chimes runs it through ``bench/noop_worker.py``.

The adapter is this module: whichever client Chimes' worker uses, the peers use through
:meth:`TaskClient.call`, which goes through the executor's ``run`` as the worker does.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from chimes.security.ssrf import EgressPolicy
from chimes.worker.tasks.common import TaskContext
from chimes.worker.tasks.http import HttpExecutor

VARIANTS = ("noop", "http")
CALL_PATH = "/call"
NOOP_PATH = "/noop"  # the URL of Chimes' no-op jobs, which bench/noop_worker.py never calls
KEY_HEADER = ("X-Api-Key", "bench-0123456789abcdef")
OWNER = "bench"
JOB_ID = "0193e000-0000-7000-8000-ffffffffffff"
SIGNING_SECRET = "whsec_bench"  # Chimes signs every HTTP task with its owner's secret: the peers' calls are signed too
TIMEOUT_SEC = 60.0


def http_task(target_url: str, path: str = CALL_PATH) -> dict[str, Any]:
    """The HTTP task as a Chimes job stores it; the peers' calls send the same."""
    return {"type": "http", "method": "POST", "url": f"{target_url}{path}", "headers": dict([KEY_HEADER])}


def run_key(system: str, i: int) -> str:
    """A peer's run id for the ``X-Chimes-Run-Id`` header: the shape (and length) of Chimes' run ids,
    so that every system sends the same bytes; the system's number keeps the keys apart."""
    number = {"pgqueuer": 1, "procrastinate": 2, "celery": 3}.get(system, 9)
    return f"0193e000-0000-7000-{8000 + number}-{i:012d}"


class CallFailed(RuntimeError):
    """The call did not succeed: the task fails, and the system records it so."""


class TaskClient:
    """One worker process's HTTP client for the **http** task: Chimes' executor, its pool made on first use."""

    def __init__(self, target_url: str) -> None:
        self._task = http_task(target_url)
        self._executor = HttpExecutor(egress=EgressPolicy.build(allow_loopback=True))

    async def call(self, key: str, scheduled_at: datetime) -> None:
        ctx = TaskContext(key, JOB_ID, 1, scheduled_at, TIMEOUT_SEC, signing_secret=SIGNING_SECRET, owner=OWNER)
        outcome = await self._executor.run(self._task, ctx)
        if not outcome.succeeded:
            raise CallFailed(outcome.error or str(outcome.status))

    async def close(self) -> None:
        await self._executor.close()
