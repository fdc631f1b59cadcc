"""The Celery app of the peer benchmark: what ``celery -A bench.celery_app worker`` loads, and what the
benchmark's producer (``bench/peer_run.py``) sends tasks through.

The broker and the result backend are the benchmark's own redis-server (``bench/celery_peer.py``),
named by ``BENCH_CELERY_BROKER`` and ``BENCH_CELERY_BACKEND``. The task body makes the same call as
every other system's: one POST to the local HTTP target. Celery task bodies are synchronous, and the
workers run them on threads (``--pool threads``), so each thread keeps one keep-alive connection to the
target: a pool as large as the worker's concurrency, as the other systems' pooled aiohttp sessions.
"""

from __future__ import annotations

import http.client
import os
import threading
from urllib.parse import urlsplit

from celery import Celery

app = Celery("bench", broker=os.environ.get("BENCH_CELERY_BROKER", "redis://127.0.0.1:6379/0"),
             backend=os.environ.get("BENCH_CELERY_BACKEND", "redis://127.0.0.1:6379/1"))
app.conf.update(
    task_serializer="json", result_serializer="json", accept_content=["json"], enable_utc=True, timezone="UTC",
    broker_connection_retry_on_startup=True,
    # The run is recorded as done in the result backend (its status and date_done): Celery's run history.
    task_ignore_result=False,
)

_connections = threading.local()


def _post(url: str) -> int:
    parts = urlsplit(url)
    conn: http.client.HTTPConnection | None = getattr(_connections, "conn", None)
    if conn is None:
        conn = _connections.conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=60)
    conn.request("POST", parts.path, body=b"{}", headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    return resp.status


@app.task(name="call")
def call(url: str) -> None:
    """The task body every system runs: one POST to the target."""
    try:
        status = _post(url)
    except (http.client.HTTPException, ConnectionError):  # the target closed an idle keep-alive connection
        _connections.conn.close()
        _connections.conn = None
        status = _post(url)
    if status >= 400:
        raise RuntimeError(f"the target answered {status}")
