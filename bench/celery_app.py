"""The Celery app of ``python -m bench peers``: what ``celery -A bench.celery_app worker`` loads, and
what the benchmark sends its tasks through (bench/peers.py).

The broker and the result backend are the benchmark's own redis-server (``bench/celery_peer.py``),
named by ``BENCH_CELERY_BROKER`` and ``BENCH_CELERY_BACKEND``; ``BENCH_TARGET_URL`` is the HTTP target.

The tasks are plain messages, no ETA: they wait in the broker on :data:`BURST_QUEUE`, which the
workers start consuming (``add_consumer``) at the due instant. The **http** task's body makes its
call through the same client as every other system (bench/task_client.py). That client runs on an
asyncio loop, and a Celery task body is synchronous: each worker process keeps one loop on a thread
of its own with the process's one :class:`~bench.task_client.TaskClient`, and a task body waits for
its call there. The worker runs its bodies on threads (``--pool threads``), as many as the process's
share of the runs in flight: gevent's and eventlet's greenlets cannot wait on an asyncio loop without
blocking their hub, and the prefork pool runs one body per process.
"""

from __future__ import annotations

import asyncio
import os
import threading
from datetime import UTC, datetime
from typing import Any

from celery import Celery

from bench.task_client import TIMEOUT_SEC, TaskClient

HOLD_QUEUE = "bench-hold"  # what the workers consume from the start: nothing is ever sent to it
BURST_QUEUE = "bench-burst"


def make_app(broker: str, backend: str | None) -> Celery:
    """``backend`` None: an app that only sends (bench/peers.py), which a result backend would have
    subscribe to every task's outcome as it sends it."""
    app = Celery("bench", broker=broker, backend=backend)
    app.conf.update(
        task_serializer="json", result_serializer="json", accept_content=["json"], enable_utc=True,
        timezone="UTC", broker_connection_retry_on_startup=True, task_default_queue=HOLD_QUEUE,
        # The outcome is recorded in the result backend (its status and date_done): Celery's run history.
        task_ignore_result=False,
    )
    return app


app = make_app(os.environ.get("BENCH_CELERY_BROKER", "redis://127.0.0.1:6379/0"),
               os.environ.get("BENCH_CELERY_BACKEND", "redis://127.0.0.1:6379/1"))


class _Caller:
    """The process's loop thread and its client, started by the first call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: TaskClient | None = None

    def call(self, key: str, due: float) -> None:
        loop, client = self._started()
        future = asyncio.run_coroutine_threadsafe(client.call(key, datetime.fromtimestamp(due, UTC)), loop)
        future.result(timeout=TIMEOUT_SEC + 5)

    def _started(self) -> tuple[asyncio.AbstractEventLoop, TaskClient]:
        with self._lock:
            if self._loop is None or self._client is None:
                import uvloop

                loop = uvloop.new_event_loop()
                threading.Thread(target=loop.run_forever, name="bench-http", daemon=True).start()
                self._client = asyncio.run_coroutine_threadsafe(_client(), loop).result()  # made on its loop
                self._loop = loop
            return self._loop, self._client


async def _client() -> TaskClient:
    return TaskClient(os.environ["BENCH_TARGET_URL"])


_caller = _Caller()


@app.task(name="call")
def call(key: str, due: float) -> None:
    """The **http** task: one call through the shared client; a failed call fails the task."""
    _caller.call(key, due)


@app.task(name="noop")
def noop(key: str, due: float) -> Any:
    """The **noop** task: nothing."""
    return None
