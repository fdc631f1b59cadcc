"""``python -m bench peers``: the same burst through Chimes and through the Python job systems a team
would use instead, PgQueuer, procrastinate and Celery, measured the same way (docs/benchmarks.md).

For every system, in every round:

- **The same work**: ``runs`` jobs due at one instant, each running the variant's task
  (bench/task_client.py): a no-op, or one POST to the target's one URL with a key header through
  Chimes' worker's own HTTP client, which every peer's worker process holds one of.
- **The same processes and concurrency**: ``workers`` worker processes (``--workers``), the runs in
  flight (``--in-flight``) shared evenly between them, each system configured as its documentation
  recommends for throughput (bench/peer_run.py, bench/celery_app.py); Chimes at its defaults, its
  worker's ``--concurrency`` set so that the owner share (0.8 of the slots for one owner) is the
  process's share of the runs in flight, and a scheduler process besides, which the peers have no
  equivalent of (their queue holds a deferred job until its time).
- **The same finish line**: one observer, this process, reads every system's committed outcomes
  (a count on its database, or on Celery's result backend) every :data:`FINISH_POLL_SEC` from the
  due instant; the drain ends at the read that first saw every run done.
- **The concurrency it really had**: the target holds each call ``--hold-ms`` before answering, so
  the calls a system has in flight overlap there, and counts the most it held at once; a system
  over its runs in flight is flagged (bench/peer_report.py) and left out of the ratios.
- **The same CPU window**: each system's processes and its database server (PostgreSQL, or Celery's
  Redis), from a second before the due instant (Chimes' scheduler fires up to a second ahead) to
  the finish line.

The systems' order alternates from round to round (bench/peer_report.py, ``round_order``), each
system on a fresh database of the same PostgreSQL (Celery: a fresh redis-server).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import asyncpg

from bench import peer_setup, quiet, seed
from bench.env import Env, drop_database, fresh_database
from bench.peer_report import round_order
from bench.procs import CpuMeter, Proc, python
from bench.report import Result, percentiles
from bench.target import TargetProcess
from bench.task_client import CALL_PATH, NOOP_PATH, VARIANTS, http_task, run_key

PEERS = {"pgqueuer": "PgQueuer", "procrastinate": "procrastinate", "celery": "Celery"}
SYSTEMS = ("chimes", *PEERS)
FINISH_POLL_SEC = 0.05
CPU_BEFORE_DUE_SEC = 1.0
# Seconds to store 1,000 jobs, generously: each system's jobs are due this long after the storing begins.
STORE_PER_1000 = {"chimes": 0.4, "pgqueuer": 0.4, "procrastinate": 0.8, "celery": 1.5}
Say = Callable[[str], None]


@dataclass(frozen=True)
class Layout:
    """What every system gets: its worker processes, the runs in flight in all, the target's hold."""

    workers: int = 1
    in_flight: int = 200
    hold_ms: float = 10.0

    @property
    def per_process(self) -> int:
        return self.in_flight // self.workers

    def problem(self) -> str | None:
        if self.workers < 1 or self.in_flight < 2:
            return "--workers must be 1 or more and --in-flight 2 or more"
        if self.in_flight % self.workers:
            return f"--in-flight ({self.in_flight}) must be shared evenly by --workers ({self.workers})"
        return None


def chimes_concurrency(per_process: int, owner_share: float) -> int:
    """The worker ``--concurrency`` whose owner cap (``int(concurrency * owner_share)``, the most runs of
    one owner a worker holds) is ``per_process``: the burst is one owner's."""
    concurrency = max(1, math.ceil(per_process / owner_share))
    while int(concurrency * owner_share) > per_process:
        concurrency -= 1
    while int(concurrency * owner_share) < per_process:
        concurrency += 1
    return concurrency


def next_poll(previous: float, now: float, every: float) -> float:
    """The next instant on the observer's grid (``previous`` plus whole ``every``s) after ``now``: a
    read that took longer than ``every`` skips the instants it overran rather than drift."""
    return previous + every * max(1, math.floor((now - previous) / every) + 1)


async def finish_line(committed: Callable[[], Awaitable[int]], runs: int, due: float, *, every: float,
                      limit_sec: float, alive: Callable[[], str | None]) -> tuple[float, int]:
    """When a read of ``committed`` first counted ``runs``: the same observer for every system, reading
    at ``due``, ``due + every``, ... (the time the read was sent, so the last outcome committed at most
    ``every`` before it). Returns that time and the count."""
    at = due
    while True:
        wait = at - time.time()
        if wait > 0:
            await asyncio.sleep(wait)
        sent = time.time()
        count = await committed()
        if count >= runs:
            return sent, count
        dead = alive()
        if dead:
            raise RuntimeError(dead)
        if sent > due + limit_sec:
            raise TimeoutError(f"{count:,} of {runs:,} runs done {limit_sec:.0f} s after the due instant")
        at = next_poll(at, time.time(), every)


class Contender(Protocol):
    """One system under test, for one measurement."""

    key: str
    label: str
    procs: list[Proc]  # its processes, whose CPU and memory are counted

    async def start(self) -> None: ...  # a fresh database, its processes up and ready
    async def store(self, runs: int) -> float: ...  # the jobs stored; the due instant (epoch seconds)
    async def committed(self) -> int: ...  # the runs whose success is committed, now
    async def check(self, runs: int) -> None: ...  # raises unless every run succeeded once
    def servers(self) -> dict[str, int | None]: ...  # the database servers whose CPU is counted
    def settings(self) -> dict[str, Any]: ...
    async def stop(self) -> None: ...


def _due(system: str, runs: int) -> float:
    return seed.due_instant(3.0 + STORE_PER_1000[system] * runs / 1000).timestamp()


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


def _dead(procs: Sequence[Proc]) -> str | None:
    dead = [p for p in procs if not p.alive()]
    return f"{dead[0].name} exited:\n{dead[0].log_tail()}" if dead else None


class ChimesContender:
    key = "chimes"

    def __init__(self, env: Env, target: TargetProcess, variant: str, layout: Layout) -> None:
        from bench.chimes_runs import FleetShape
        from chimes.worker.tiers import OWNER_SHARE

        self.env, self.target, self.variant, self.layout = env, target, variant, layout
        self.label = f"Chimes {_version('chimes')}"
        self.shape = FleetShape(1, layout.workers, chimes_concurrency(layout.per_process, OWNER_SHARE),
                                owner_share=None, noop=variant == "noop")
        self.owner_share = OWNER_SHARE
        self.procs: list[Proc] = []
        self.pool: asyncpg.Pool | None = None
        self.fleet: Any = None

    async def start(self) -> None:
        from bench.chimes_runs import Fleet

        dsn = await fresh_database(self.env, self.env.database("chimes"), chimes_schema=True)
        self.fleet = Fleet(self.env, dsn, self.shape, f"peers-{self.variant}")
        self.procs = self.fleet.procs
        from chimes.store import db

        self.pool = await db.create_pool(dsn, max_size=2)  # Chimes' codecs: the jobs go in as the API's do
        await self.fleet.wait_ready()

    async def store(self, runs: int) -> float:
        from chimes.jobs import JobSpec

        assert self.pool is not None
        due = _due(self.key, runs)
        spec = JobSpec.model_validate({
            "name": "peers", "schedule": seed.at(datetime.fromtimestamp(due, UTC)), "timeoutSec": 60,
            "task": http_task(self.target.url, CALL_PATH if self.variant == "http" else NOOP_PATH),
            "concurrency": "allow"})
        await seed.add_jobs(self.pool, spec, runs)
        return due

    async def committed(self) -> int:
        assert self.pool is not None
        return int(await self.pool.fetchval("SELECT count(*) FROM runs WHERE status = 'succeeded'"))

    async def check(self, runs: int) -> None:
        assert self.pool is not None
        statuses = {r["status"]: r["n"] for r in await self.pool.fetch(
            "SELECT status, count(*) AS n FROM runs GROUP BY status")}
        if statuses != {"succeeded": runs}:
            raise RuntimeError(f"Chimes' runs by status: {statuses}, not {runs} succeeded")

    def servers(self) -> dict[str, int | None]:
        return self.env.postmasters()

    def settings(self) -> dict[str, Any]:
        return {"scheduler_processes": 1, "worker_processes": self.layout.workers,
                "worker_concurrency": self.shape.concurrency,
                "owner_share": f"{self.owner_share} (the default): {self.layout.per_process} runs of one owner "
                               "a worker",
                "warnings": self.fleet.warnings() if self.fleet else {}}

    async def stop(self) -> None:
        if self.pool is not None:
            await self.pool.close()
        if self.fleet is not None:
            self.fleet.stop()
        await drop_database(self.env, self.env.database("chimes"))


class _PostgresPeer:
    """PgQueuer and procrastinate: worker processes of bench/peer_run.py on a database of their own."""

    key = ""

    def __init__(self, env: Env, target: TargetProcess, variant: str, layout: Layout) -> None:
        self.env, self.target, self.variant, self.layout = env, target, variant, layout
        self.label = f"{PEERS[self.key]} {_version(self.key)}"
        self.procs: list[Proc] = []
        self.dsn = ""
        self.conn: asyncpg.Connection | None = None

    async def start(self) -> None:
        self.dsn = await fresh_database(self.env, self.env.database(self.key))
        self.conn = await asyncpg.connect(self.dsn)
        await self.install()
        ready = []
        for i in range(self.layout.workers):
            name = f"{self.key}-worker{i + 1}" if self.layout.workers > 1 else f"{self.key}-worker"
            flag = self.env.workdir / f"{name}.ready"
            flag.unlink(missing_ok=True)
            ready.append(flag)
            self.procs.append(Proc(name, python("-m", "bench.peer_run", self.key, "--dsn", self.dsn, "--variant",
                                                self.variant, "--url", self.target.url, "--in-flight",
                                                str(self.layout.per_process), "--ready", str(flag)),
                                   self.env.workdir / f"{name}.log"))
        await _wait_files(ready, self.procs)

    async def install(self) -> None:
        raise NotImplementedError

    def servers(self) -> dict[str, int | None]:
        return self.env.postmasters()

    async def stop(self) -> None:
        for proc in self.procs:
            proc.stop()
        if self.conn is not None:
            await self.conn.close()
        await drop_database(self.env, self.env.database(self.key))


class PgQueuerContender(_PostgresPeer):
    key = "pgqueuer"
    runs = 0

    async def install(self) -> None:
        from pgqueuer import AsyncpgDriver, Queries

        assert self.conn is not None
        await Queries(AsyncpgDriver(self.conn)).install()

    async def store(self, runs: int) -> float:
        from pgqueuer import AsyncpgDriver, Queries

        from bench.peer_run import payload

        assert self.conn is not None
        self.runs = runs
        due = _due(self.key, runs)
        queries = Queries(AsyncpgDriver(self.conn))
        for first in range(0, runs, 1000):
            count = min(runs, first + 1000) - first
            after = datetime.fromtimestamp(due, UTC) - datetime.now(UTC)
            await queries.enqueue(["call"] * count, [payload(run_key(self.key, first + i), due) for i in range(count)],
                                  [0] * count, [after] * count)
        return due

    async def committed(self) -> int:  # a finished job leaves the queue for the log in one statement
        assert self.conn is not None
        return int(await self.conn.fetchval("SELECT $1::bigint - count(*) FROM pgqueuer", self.runs))

    async def check(self, runs: int) -> None:
        assert self.conn is not None
        logged = {r["status"]: r["n"] for r in await self.conn.fetch(
            "SELECT status::text, count(DISTINCT job_id) AS n FROM pgqueuer_log "
            "WHERE status NOT IN ('queued', 'picked') GROUP BY status")}
        if logged != {"successful": runs}:
            raise RuntimeError(f"PgQueuer's log by final status: {logged}, not {runs} successful")

    def settings(self) -> dict[str, Any]:
        from bench.peer_run import pgqueuer_layout

        return {"worker_processes": self.layout.workers, "driver": "AsyncpgDriver",
                "per_process": pgqueuer_layout(self.layout.per_process).to_json()}


class ProcrastinateContender(_PostgresPeer):
    key = "procrastinate"
    app: Any = None

    async def install(self) -> None:
        import procrastinate

        connector = procrastinate.PsycopgConnector(conninfo=self.dsn, min_size=1, max_size=2)
        self.app = procrastinate.App(connector=connector)
        await self.app.open_async()
        await self.app.schema_manager.apply_schema_async()

    async def store(self, runs: int) -> float:
        due = _due(self.key, runs)
        deferrer = self.app.configure_task("call", schedule_at=datetime.fromtimestamp(due, UTC))
        for first in range(0, runs, 1000):
            await deferrer.batch_defer_async(*({"key": run_key(self.key, i), "due": due}
                                               for i in range(first, min(runs, first + 1000))))
        return due

    async def committed(self) -> int:
        assert self.conn is not None
        return int(await self.conn.fetchval("SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"))

    async def check(self, runs: int) -> None:
        assert self.conn is not None
        statuses = {r["status"]: r["n"] for r in await self.conn.fetch(
            "SELECT status::text, count(*) AS n FROM procrastinate_jobs GROUP BY status")}
        if statuses != {"succeeded": runs}:
            raise RuntimeError(f"procrastinate's jobs by status: {statuses}, not {runs} succeeded")

    def settings(self) -> dict[str, Any]:
        from bench.peer_run import PROCRASTINATE_POLL_SEC

        return {"worker_processes": self.layout.workers, "connector": "PsycopgConnector",
                "per_process": {"concurrency": self.layout.per_process,
                                "fetch_job_polling_interval": PROCRASTINATE_POLL_SEC, "listen_notify": True}}

    async def stop(self) -> None:
        if self.app is not None:
            await self.app.close_async()
        await super().stop()


class CeleryContender:
    """Celery's own processes (bench/celery_peer.py): a redis-server, and ``celery worker`` processes
    that begin consuming the burst's queue at the due instant."""

    key = "celery"

    def __init__(self, env: Env, target: TargetProcess, variant: str, layout: Layout) -> None:
        self.env, self.target, self.variant, self.layout = env, target, variant, layout
        self.label = f"Celery {_version('celery')}"
        self.procs: list[Proc] = []
        self.broker: Any = None
        self.app: Any = None
        self.backend: Any = None
        self.opening: asyncio.Task[None] | None = None
        self.ids: list[str] = []

    async def start(self) -> None:
        import redis.asyncio

        from bench import celery_peer
        from bench.celery_app import make_app

        self.broker = celery_peer.RedisServer(self.env.workdir)
        self.procs.append(self.broker.proc)
        self.procs += celery_peer.start_workers(self.env.workdir, self.broker, workers=self.layout.workers,
                                                concurrency=self.layout.per_process, target_url=self.target.url)
        # No result backend for the sender: the workers record the outcomes; this process reads them
        # from the backend's database itself, rather than subscribe to each one as it sends the task.
        self.app = make_app(self.broker.url(celery_peer.BROKER_DB), None)
        self.backend = redis.asyncio.Redis.from_url(self.broker.url(celery_peer.BACKEND_DB))
        deadline = time.monotonic() + 60
        while len(await asyncio.to_thread(self.app.control.ping, timeout=0.5)) < self.layout.workers:
            dead = _dead(self.procs)
            if dead:
                raise RuntimeError(dead)
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {self.layout.workers} Celery workers answered a ping within 60 s")

    async def store(self, runs: int) -> float:
        from bench.celery_app import BURST_QUEUE

        due = _due(self.key, runs)
        task = "call" if self.variant == "http" else "noop"

        def send() -> list[str]:
            with self.app.producer_or_acquire() as producer:
                return [self.app.send_task(task, args=[run_key(self.key, i), due], queue=BURST_QUEUE,
                                           producer=producer).id for i in range(runs)]

        self.ids = await asyncio.to_thread(send)
        self.opening = asyncio.create_task(self._open_at(due))
        return due

    async def _open_at(self, due: float) -> None:
        """At the due instant every worker begins consuming the burst's queue (Celery's remote control)."""
        from bench.celery_app import BURST_QUEUE

        await asyncio.sleep(max(0.0, due - time.time()))
        replies = await asyncio.to_thread(self.app.control.add_consumer, BURST_QUEUE, reply=True, timeout=5)
        if len(replies) < self.layout.workers or not all("ok" in r for reply in replies for r in reply.values()):
            raise RuntimeError(f"not every Celery worker took the burst's queue: {replies}")

    async def committed(self) -> int:  # the backend's database holds one key per finished task
        if self.opening is not None and self.opening.done():
            self.opening.result()  # a failed add_consumer stops the measurement
        return int(await self.backend.dbsize())

    async def check(self, runs: int) -> None:
        import orjson

        keys = [f"celery-task-meta-{i}" for i in self.ids]
        metas = [None if v is None else orjson.loads(v)
                 for first in range(0, len(keys), 1000) for v in await self.backend.mget(keys[first:first + 1000])]
        statuses: dict[str, int] = {}
        for meta in metas:
            status = "none" if meta is None else str(meta["status"])
            statuses[status] = statuses.get(status, 0) + 1
        if statuses != {"SUCCESS": runs} or await self.backend.dbsize() != runs:
            raise RuntimeError(f"Celery's outcomes by status: {statuses}, not {runs} SUCCESS")

    def servers(self) -> dict[str, int | None]:
        return {}  # Celery does not use PostgreSQL; its Redis is among its processes

    def settings(self) -> dict[str, Any]:
        return {"worker_processes": self.layout.workers, "pool": "threads",
                "per_process": {"concurrency": self.layout.per_process, "prefetch_multiplier": 4},
                "broker": "redis-server (Debian), appendfsync everysec", "result_backend": "redis",
                "eta": False, "start": "add_consumer at the due instant"}

    async def stop(self) -> None:
        if self.opening is not None:
            self.opening.cancel()
            await asyncio.gather(self.opening, return_exceptions=True)
        if self.backend is not None:
            await self.backend.aclose()
        if self.app is not None:
            self.app.close()
        for proc in reversed(self.procs):
            proc.stop(timeout=10)


CONTENDERS: dict[str, Callable[[Env, TargetProcess, str, Layout], Contender]] = {
    "chimes": ChimesContender, "pgqueuer": PgQueuerContender, "procrastinate": ProcrastinateContender,
    "celery": CeleryContender,
}


async def _wait_files(files: Sequence[Path], procs: Sequence[Proc], limit_sec: float = 60.0) -> None:
    deadline = time.monotonic() + limit_sec
    while not all(f.exists() for f in files):
        dead = _dead(procs)
        if dead:
            raise RuntimeError(dead)
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every worker process was ready within {limit_sec:.0f} s")
        await asyncio.sleep(0.1)


async def measure(env: Env, target: TargetProcess, system: str, variant: str, runs: int, layout: Layout,
                  say: Say) -> Result:
    """One system through one variant: its jobs stored, then the drain to the shared finish line."""
    contender = CONTENDERS[system](env, target, variant, layout)
    await target.reset(layout.hold_ms if variant == "http" else 0)
    try:
        await contender.start()
        due = await contender.store(runs)
        say(f"{contender.label}, {variant}: {runs:,} jobs stored, due at "
            f"{time.strftime('%H:%M:%S', time.localtime(due))}")
        if time.time() > due - CPU_BEFORE_DUE_SEC - 0.2:
            raise RuntimeError(f"{system} took longer to store its jobs than the lead it was given")
        await asyncio.sleep(due - CPU_BEFORE_DUE_SEC - time.time())
        meter = CpuMeter(contender.procs, contender.servers())
        meter.start()
        finished, completed = await finish_line(
            contender.committed, runs, due, every=FINISH_POLL_SEC, limit_sec=120 + runs / 50,
            alive=lambda: _dead(contender.procs))
        cpu = meter.stop()
        await contender.check(runs)
        settings = contender.settings()
        peaks = {p.name: round(p.peak_rss_mb(), 1) for p in contender.procs}
    finally:
        await contender.stop()
    times, keys = await target.arrivals()
    most = await target.most_in_flight()
    expected_calls = runs if variant == "http" else 0
    if len(times) != expected_calls or len(set(keys)) != expected_calls:
        raise RuntimeError(f"{contender.label}, {variant}: the target had {len(times):,} calls ({len(set(keys)):,} "
                           f"runs), not {expected_calls:,}: each run calls it once in this variant")
    starts = [t - due for t in times]
    result = Result(contender.label, "peers", runs, completed, finished - due, start_lag=percentiles(starts),
                    cpu_sec=cpu, peak_mb=peaks, start_lags=starts)
    result.extra = {"system_key": system, "variant": variant, "settings": settings,
                    "worker_processes": layout.workers, "hold_ms": layout.hold_ms if variant == "http" else 0,
                    "in_flight": {"stated": layout.in_flight, "most_at_target": most if variant == "http" else None},
                    "calls": len(times), "finish_poll_sec": FINISH_POLL_SEC,
                    "cpu_from_sec_before_due": CPU_BEFORE_DUE_SEC}
    return result


def argument_problem(systems: Sequence[str], variants: Sequence[str], layout: Layout) -> str | None:
    """What is wrong with the command's systems, variants and layout; None when nothing is."""
    unknown = [s for s in systems if s not in SYSTEMS] + [v for v in variants if v not in VARIANTS]
    if unknown:
        return (f"unknown system or variant {unknown[0]!r}; systems: {', '.join(SYSTEMS)}; "
                f"variants: {', '.join(VARIANTS)}")
    if layout.hold_ms < 0 or layout.hold_ms > 60_000:
        return f"--hold-ms must be 0 to 60000, not {layout.hold_ms:g}"
    return layout.problem()


async def peers(env: Env, target: TargetProcess, *, runs: int, systems: list[str], variants: list[str],
                layout: Layout, rounds: int, say: Say,
                settle: Callable[[], Awaitable[None]] | None = None) -> list[Result]:
    """Every variant through every system, ``rounds`` times, the systems' order alternating; before
    each measurement ``settle`` is awaited, so that none starts in the load the one before left."""
    problem = argument_problem(systems, variants, layout)
    if problem:
        raise SystemExit(problem)
    # What a peer needs is installed, or the peer skipped, before any system runs.
    systems = peer_setup.prepare(systems, say)
    results: list[Result] = []
    records: list[quiet.Quietness] = []
    for index in range(rounds):
        for variant in variants:
            for system in round_order(systems, index):
                if settle is not None:
                    await settle()
                async with quiet.watch() as quietness:
                    result = await measure(env, target, system, variant, runs, layout, say)
                result.extra |= {"round": index + 1, "machine": quietness.to_json()}
                most = result.extra["in_flight"]["most_at_target"]
                say(f"round {index + 1}, {variant}: {result.system} drained {result.completed:,} runs in "
                    f"{result.drain_sec or 0:.2f} s" + (f", {most} calls at once at most" if most is not None else "")
                    + f"; {quietness.describe()}")
                results.append(result)
                records.append(quietness)
    spread = quiet.probe_spread(records)
    if spread:
        say(spread)
    return results
