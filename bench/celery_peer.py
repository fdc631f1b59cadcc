"""Celery's processes in the peer benchmark: a redis-server of the benchmark's own (Debian's
``redis-server``, on a free 127.0.0.1 port, its files in the work folder) as broker and result
backend, and real ``celery worker`` processes. The benchmark itself sends the tasks
(bench/peers.py), as it stores the other systems' jobs.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from bench.procs import Proc, free_port, python

BROKER_DB, BACKEND_DB = 0, 1


def check_redis_server() -> str:
    """The path of Debian's redis-server; a clear stop when it is missing."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (Celery's broker): apt-get install -y redis-server")
    return binary


class RedisServer:
    """A redis-server started for one measurement and stopped after it. The append-only file is on
    and flushed every second (Redis' own advice for a queue that should survive a restart; the
    PostgreSQL-based systems flush every commit)."""

    def __init__(self, workdir: Path, name: str = "redis") -> None:
        binary = check_redis_server()
        folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=workdir))  # fresh: no earlier round's data
        self.port = free_port()
        self.proc = Proc(name, [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(folder),
                                "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
                                "--daemonize", "no", "--logfile", ""], workdir / f"{name}.log")
        try:
            self._wait_ready()
        except BaseException:
            self.proc.stop()
            raise

    def url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def _wait_ready(self, limit_sec: float = 20.0) -> None:
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + limit_sec
        try:
            while True:
                if not self.proc.alive():
                    raise RuntimeError(f"redis-server exited:\n{self.proc.log_tail()}")
                try:
                    if client.ping():
                        return
                except redis.exceptions.RedisError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer within {limit_sec}s:\n{self.proc.log_tail()}")
                # The poll interval of a wait bounded by the deadline: redis-server announces nothing.
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        self.proc.stop(timeout=10)


def broker_env(broker: RedisServer) -> dict[str, str]:
    return {"BENCH_CELERY_BROKER": broker.url(BROKER_DB), "BENCH_CELERY_BACKEND": broker.url(BACKEND_DB)}


def start_workers(workdir: Path, broker: RedisServer, *, workers: int, concurrency: int, target_url: str) -> list[Proc]:
    """``workers`` ``celery worker`` processes, each running ``concurrency`` task bodies at once on
    threads, consuming only the queue nothing is sent to until the burst's queue is added
    (bench/celery_app.py)."""
    from bench.celery_app import HOLD_QUEUE

    procs = []
    for i in range(workers):
        name = f"celery-worker{i + 1}" if workers > 1 else "celery-worker"
        procs.append(Proc(name, python("-m", "celery", "-A", "bench.celery_app", "worker", "--pool", "threads",
                                       "--concurrency", str(concurrency), "--queues", HOLD_QUEUE,
                                       "--loglevel", "WARNING", "--without-gossip", "--without-mingle",
                                       "--hostname", f"{name}@%h"),
                          workdir / f"{name}.log", broker_env(broker) | {"BENCH_TARGET_URL": target_url}))
    return procs
