"""One worker process of a PostgreSQL-based peer in ``python -m bench peers``:
``python -m bench.peer_run SYSTEM --dsn DSN --variant noop|http --url TARGET --in-flight K --ready FILE``.

It runs the peer's own worker on the peer's database, as that project's documentation recommends for
throughput, at most ``K`` task bodies at once, until SIGTERM; it writes ``FILE`` once it works. The
task body is the variant's (bench/task_client.py): nothing, or one call through the process's one
:class:`~bench.task_client.TaskClient`. Jobs are stored by the benchmark itself (bench/peers.py)
after every worker process is up; each carries its run key and the due instant.

- **PgQueuer**: several queue managers in the process, each on a connection of its own, as PgQueuer's
  own benchmark runs them (``tools/benchmark.py``: five, batch size 10); ``K`` split between them as
  each one's ``max_concurrent_tasks`` (which PgQueuer enforces in its dequeue query).
- **procrastinate**: one worker with ``concurrency=K`` (its jobs run on the loop, ``K`` at once),
  LISTEN/NOTIFY on and a 0.1 s job poll: a job deferred to a later instant is found by the poll.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.task_client import TaskClient

PGQUEUER_MANAGERS = 5  # PgQueuer's benchmark: five queue managers ...
PGQUEUER_BATCH = 10  # ... each dequeuing 10 jobs at a time
PROCRASTINATE_POLL_SEC = 0.1


@dataclass(frozen=True)
class PgQueuerLayout:
    """How one process's ``in_flight`` is shared between its queue managers: PgQueuer wants each
    manager's ``max_concurrent_tasks`` to be at least twice its batch size."""

    batch_size: int
    per_manager: tuple[int, ...]  # each manager's max_concurrent_tasks

    def to_json(self) -> dict[str, Any]:
        return {"queue_managers": len(self.per_manager), "batch_size": self.batch_size,
                "max_concurrent_tasks": list(self.per_manager)}


def pgqueuer_layout(in_flight: int, managers: int = PGQUEUER_MANAGERS,
                    batch_size: int = PGQUEUER_BATCH) -> PgQueuerLayout:
    if in_flight < 2:
        raise ValueError("PgQueuer needs 2 runs in flight at least (twice a batch of one)")
    batch = min(batch_size, in_flight // 2)
    count = max(1, min(managers, in_flight // (2 * batch)))
    share, extra = divmod(in_flight, count)
    return PgQueuerLayout(batch, tuple(share + (1 if i < extra else 0) for i in range(count)))


def parse_payload(payload: bytes) -> tuple[str, datetime]:
    """A job's payload: its run key and the due instant (epoch seconds), space-separated."""
    key, _, due = payload.decode().partition(" ")
    return key, datetime.fromtimestamp(float(due), UTC)


def payload(key: str, due: float) -> bytes:
    return f"{key} {due}".encode()


class Body:
    """The variant's task body, shared by every job of the process."""

    def __init__(self, variant: str, url: str) -> None:
        self.client = TaskClient(url) if variant == "http" else None

    async def run(self, key: str, due: datetime) -> None:
        if self.client is not None:
            await self.client.call(key, due)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()


async def run_pgqueuer(args: argparse.Namespace, body: Body, stop: asyncio.Event) -> dict[str, Any]:
    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries, QueueManager

    layout = pgqueuer_layout(args.in_flight)
    managers = []
    for _ in layout.per_manager:
        manager = QueueManager(Queries(AsyncpgDriver(await asyncpg.connect(args.dsn))))

        @manager.entrypoint("call")
        async def call(job: Any) -> None:
            await body.run(*parse_payload(job.payload))

        managers.append(manager)
    running = [asyncio.create_task(m.run(dequeue_timeout=timedelta(seconds=30), batch_size=layout.batch_size,
                                         max_concurrent_tasks=most))
               for m, most in zip(managers, layout.per_manager, strict=True)]
    _ready(args.ready)
    await _until(stop, running)
    for manager in managers:
        manager.shutdown.set()
    await asyncio.gather(*running, return_exceptions=True)
    return layout.to_json()


async def run_procrastinate(args: argparse.Namespace, body: Body, stop: asyncio.Event) -> dict[str, Any]:
    import procrastinate

    # a job holds no connection while it runs; its fetch and its outcome take one each
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=args.dsn, max_size=args.in_flight + 2))

    @app.task(name="call")
    async def call(key: str, due: float) -> None:
        await body.run(key, datetime.fromtimestamp(due, UTC))

    async with app.open_async():
        worker = asyncio.create_task(app.run_worker_async(
            concurrency=args.in_flight, fetch_job_polling_interval=PROCRASTINATE_POLL_SEC, listen_notify=True,
            install_signal_handlers=False))
        _ready(args.ready)
        await _until(stop, [worker])
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
    return {"concurrency": args.in_flight, "fetch_job_polling_interval": PROCRASTINATE_POLL_SEC,
            "listen_notify": True}


async def _until(stop: asyncio.Event, running: list[asyncio.Task[Any]]) -> None:
    """Until SIGTERM, or until a worker ends on its own (an error: it is raised)."""
    stopping = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([stopping, *running], return_when=asyncio.FIRST_COMPLETED)
    for task in done:
        if task is not stopping:
            task.result()
            raise RuntimeError("a worker ended before it was stopped")
    stopping.cancel()


def _ready(path: Path) -> None:
    path.write_text("ready")


async def main(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    body = Body(args.variant, args.url)
    try:
        if args.system == "pgqueuer":
            await run_pgqueuer(args, body, stop)
        else:
            await run_procrastinate(args, body, stop)
    finally:
        await body.close()


def cli() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.peer_run")
    parser.add_argument("system", choices=["pgqueuer", "procrastinate"])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--variant", choices=["noop", "http"], required=True)
    parser.add_argument("--url", required=True, help="the HTTP target's base URL")
    parser.add_argument("--in-flight", type=int, required=True, help="task bodies this process runs at once")
    parser.add_argument("--ready", type=Path, required=True, help="written once the worker runs")
    import uvloop

    uvloop.run(main(parser.parse_args()))


if __name__ == "__main__":
    cli()
