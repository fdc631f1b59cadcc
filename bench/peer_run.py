"""One peer scheduler through the burst, in its own process: ``python -m bench.peer_run SYSTEM ...``.

Every peer gets the same work as Chimes: ``runs`` one-off jobs due at the same instant, each calling
the same local HTTP target once (one pooled aiohttp session per process, as Chimes' worker has),
with its state in a database of its own on the same PostgreSQL (Celery: in its own redis-server, with
its workers in processes of their own, ``bench/celery_peer.py``). Each is configured for low latency
(short polls, misfires never dropped); the settings are written into the result.

The process writes ``OUT.seeded`` once every job is stored (the orchestrator starts counting the
database's CPU then) and ``OUT`` (JSON) at the end: the due time, when each task body finished,
when the system had recorded every run as done, its own CPU seconds and peak memory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import orjson

# Shared by the task bodies of this process, as a worker shares its pooled HTTP session.
STATE: dict[str, Any] = {"session": None, "url": "", "finished": [], "runs": 0, "all_done": None}


async def call_target(key: str) -> None:
    """The task body every system runs: one POST to the target, then note when it ended."""
    async with STATE["session"].post(f"{STATE['url']}/r/{key}", data=b"{}") as resp:
        await resp.read()
        resp.raise_for_status()
    STATE["finished"].append(time.time())
    if len(STATE["finished"]) >= STATE["runs"]:
        STATE["all_done"].set()


async def apscheduler_job(key: str) -> None:
    """APScheduler stores a reference to this module-level function (its jobs are pickled)."""
    await call_target(key)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _wait_bodies(runs: int, deadline: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(STATE["all_done"].wait(), timeout=max(0.0, deadline - time.time()))


async def _poll(check: Callable[[], Awaitable[bool]], deadline: float) -> float:
    """Poll the system's own bookkeeping until it says every run is done; returns when it did."""
    while not await check():
        if time.time() > deadline:
            raise TimeoutError("the system did not record every run as done in time")
        await asyncio.sleep(0.05)
    return time.time()


async def run_apscheduler(dsn: str, runs: int, due: datetime, seeded: Callable[[], None]) -> dict[str, Any]:
    from apscheduler.executors.asyncio import AsyncIOExecutor
    from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
    from apscheduler.schedulers.asyncio import AsyncIOScheduler

    url = dsn.replace("postgresql://", "postgresql+psycopg://", 1)
    settings = {"jobstore": "SQLAlchemyJobStore (psycopg 3)", "executor": "AsyncIOExecutor",
                "misfire_grace_time": None, "coalesce": False}
    scheduler = AsyncIOScheduler(jobstores={"default": SQLAlchemyJobStore(url=url)},
                                 executors={"default": AsyncIOExecutor()},
                                 job_defaults={"misfire_grace_time": None, "coalesce": False}, timezone=UTC)
    scheduler.start(paused=True)
    for i in range(runs):
        scheduler.add_job(apscheduler_job, "date", run_date=due, args=[f"apscheduler-{i}"], id=f"job-{i}")
    seeded()
    scheduler.resume()
    deadline = due.timestamp() + 300 + runs / 50
    await _wait_bodies(runs, deadline)
    recorded = time.time()  # a one-off job leaves the job store when it is submitted: nothing more to wait for
    scheduler.shutdown(wait=False)
    return {"settings": settings, "recorded_at": recorded}


async def run_procrastinate(dsn: str, runs: int, due: datetime, seeded: Callable[[], None],
                            concurrency: int) -> dict[str, Any]:
    import procrastinate

    settings = {"concurrency": concurrency, "fetch_job_polling_interval": 0.1, "listen_notify": True,
                "connector": "PsycopgConnector"}
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn, max_size=concurrency + 5))

    @app.task(name="call")
    async def call(key: str) -> None:
        await call_target(key)

    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        for first in range(0, runs, 1000):
            batch = [{"key": f"procrastinate-{i}"} for i in range(first, min(runs, first + 1000))]
            await call.configure(schedule_at=due).batch_defer_async(*batch)
        seeded()
        worker = asyncio.create_task(app.run_worker_async(
            concurrency=concurrency, fetch_job_polling_interval=0.1, install_signal_handlers=False))
        deadline = due.timestamp() + 300 + runs / 50
        await _wait_bodies(runs, deadline)

        async def all_succeeded() -> bool:
            async with app.connector.pool.connection() as conn, conn.cursor() as cur:
                await cur.execute("SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'")
                row = await cur.fetchone()
            return row is not None and row[0] >= runs

        recorded = await _poll(all_succeeded, deadline)
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
    return {"settings": settings, "recorded_at": recorded}


async def run_pgqueuer(dsn: str, runs: int, due: datetime, seeded: Callable[[], None],
                       batch_size: int) -> dict[str, Any]:
    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries, QueueManager

    settings = {"driver": "AsyncpgDriver", "batch_size": batch_size, "dequeue_timeout_sec": 0.5}
    setup = await asyncpg.connect(dsn)
    await Queries(AsyncpgDriver(setup)).install()
    enqueue = Queries(AsyncpgDriver(setup))
    for first in range(0, runs, 1000):
        count = min(runs, first + 1000) - first
        after = due - datetime.now(UTC)
        await enqueue.enqueue(["call"] * count, [f"pgqueuer-{first + i}".encode() for i in range(count)],
                              [0] * count, [after] * count)
    seeded()
    worker_conn = await asyncpg.connect(dsn)
    manager = QueueManager(Queries(AsyncpgDriver(worker_conn)))

    @manager.entrypoint("call")
    async def call(job: Any) -> None:
        await call_target(job.payload.decode())

    worker = asyncio.create_task(manager.run(dequeue_timeout=timedelta(seconds=0.5), batch_size=batch_size))
    deadline = due.timestamp() + 300 + runs / 50
    await _wait_bodies(runs, deadline)

    async def queue_empty() -> bool:  # a finished job leaves the queue for the log in the same statement
        return await setup.fetchval("SELECT count(*) FROM pgqueuer") == 0

    recorded = await _poll(queue_empty, deadline)
    manager.shutdown.set()
    await asyncio.gather(worker, return_exceptions=True)
    await worker_conn.close()
    await setup.close()
    return {"settings": settings, "recorded_at": recorded}


async def run_celery(runs: int, due: datetime, seeded: Callable[[], None], url: str,
                     workers: int) -> dict[str, Any]:
    """ETA tasks: each is sent to the broker at once and held by a worker until its time comes (Celery's
    one-off jobs; beat only sends recurring ones). Done is when the result backend holds every
    task's outcome."""
    import redis

    from bench.celery_app import app, call

    settings = {"broker": "redis-server (Debian), appendfsync everysec", "result_backend": "redis",
                "pool": "threads", "eta": True, "prefetch_multiplier": app.conf.worker_prefetch_multiplier,
                "acks_late": app.conf.task_acks_late}
    deadline = time.time() + 60
    while len(await asyncio.to_thread(app.control.ping, timeout=0.5)) < workers:
        if time.time() > deadline:
            raise TimeoutError(f"fewer than {workers} Celery workers answered a ping within 60 s")

    backend = redis.Redis.from_url(app.conf.result_backend)
    if backend.dbsize():
        raise RuntimeError("the result backend holds outcomes before any task was sent")

    def send() -> list[str]:
        with app.producer_or_acquire() as producer:
            return [call.apply_async(args=[f"{url}/r/celery-{i}"], eta=due, producer=producer).id
                    for i in range(runs)]

    ids = await asyncio.to_thread(send)
    seeded()
    deadline = due.timestamp() + 300 + runs / 50

    async def all_recorded() -> bool:  # the backend's database holds one key per finished task
        return await asyncio.to_thread(backend.dbsize) >= runs

    recorded = await _poll(all_recorded, deadline)
    metas = await asyncio.to_thread(_task_metas, backend, ids)
    backend.close()
    failed = [m for m in metas if m is None or m["status"] != "SUCCESS"]
    if failed:
        first = next((m for m in failed if m is not None), None)
        raise RuntimeError(f"{len(failed)} of {runs} tasks have no outcome or not SUCCESS"
                           + (f": {first.get('traceback')}" if first else ""))
    # when each body ended: the worker stores the outcome as it returns
    STATE["finished"] = [_utc(m["date_done"]).timestamp() for m in metas if m is not None]
    return {"settings": settings, "recorded_at": recorded}


def _utc(text: str) -> datetime:
    when = datetime.fromisoformat(text)
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def _task_metas(backend: Any, ids: list[str]) -> list[dict[str, Any] | None]:
    """Each sent task's outcome as the result backend holds it (None: none yet)."""
    keys = [f"celery-task-meta-{i}" for i in ids]
    return [None if v is None else orjson.loads(v)
            for first in range(0, len(keys), 1000) for v in backend.mget(keys[first:first + 1000])]


# seconds to store 1,000 jobs, generously
LEAD_PER_1000 = {"apscheduler": 4.0, "procrastinate": 0.5, "pgqueuer": 0.3, "celery": 1.5}


async def main(args: argparse.Namespace) -> None:
    STATE["url"] = args.url
    STATE["runs"] = args.runs
    STATE["all_done"] = asyncio.Event()
    STATE["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1000))
    due = (datetime.now(UTC) + timedelta(seconds=4 + LEAD_PER_1000[args.system] * args.runs / 1000)).replace(
        microsecond=0)
    marks: dict[str, float] = {}

    def seeded() -> None:
        marks["cpu"] = _cpu()
        marks["at"] = time.time()
        _write(Path(f"{args.out}.seeded"), str(due.timestamp()).encode())

    if args.system == "apscheduler":
        outcome = await run_apscheduler(args.dsn, args.runs, due, seeded)
    elif args.system == "procrastinate":
        outcome = await run_procrastinate(args.dsn, args.runs, due, seeded, args.concurrency)
    elif args.system == "celery":
        outcome = await run_celery(args.runs, due, seeded, args.url, args.workers)
    else:
        outcome = await run_pgqueuer(args.dsn, args.runs, due, seeded, args.batch_size)
    await STATE["session"].close()
    result = {"due": due.timestamp(), "seeded_at": marks["at"], "finished": STATE["finished"],
              "cpu_sec": _cpu() - marks["cpu"], "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              **outcome}
    _write(Path(args.out), orjson.dumps(result))


def _write(path: Path, data: bytes) -> None:
    path.write_bytes(data)


def cli() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("system", choices=sorted(LEAD_PER_1000))
    parser.add_argument("--dsn", default="", help="the system's database (not Celery: its broker is Redis)")
    parser.add_argument("--runs", type=int, required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--workers", type=int, default=1, help="Celery: the worker processes to wait for")
    import uvloop

    uvloop.run(main(parser.parse_args()))


if __name__ == "__main__":
    cli()
