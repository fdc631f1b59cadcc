"""``python -m bench shards``: the same burst over 1, 2 and 4 shards, side by side in one command.

Each shard is an embedded PostgreSQL server of its own (chimes.store.embedded), all on this machine;
the first is the catalog and keeps the first range of partitions, and each other server is given an
even share of the 1,024 as ``chimes shards add URL --partitions FIRST-LAST`` gives it (its function,
chimes.store.shards.add_shard, in this process: no CLI start-up per shard), before the fleet starts
(the roles read the map when they start, docs/scaling.md, "Shards"). For each configuration, on fresh
databases:

- **the burst** (as ``burst``, bench/chimes_runs.py): N one-off HTTP jobs due in one second, put in
  their homes by partition, fired by one ``chimes scheduler`` process and run by the workers
  (``--workers``) against the bench target. Reported: runs/s, start lag, CPU per run of each process
  and of each PostgreSQL server, WAL per run of each server, and the connections each role held on
  each server: sampled every second from ``pg_stat_activity``, each backend tied to its process
  by its client port (so the servers listen on 127.0.0.1, each on a port of its own, and are reached
  over TCP, as shards on other machines are);
- **the API's routing** (the fewest and the most shards): a ``chimes api`` on each, at once, on
  databases of their own; ``--creates`` jobs created one at a time, then each read back with
  ``GET /jobs/{id}``: CPU per request of the API and of the servers (each API alone), and latency
  with the APIs taking turns request by request (side by side);
- **the blast radius** (the largest configuration with 2 or more shards): the same burst again with
  the last shard's PostgreSQL stopped (SIGSTOP, the postmaster and every backend) at the due second,
  until every run of the other shards has succeeded; then it is let go (SIGCONT) and its runs finish
  too. Compared: the start lag of the healthy shards' runs with one stopped, and of the same shards'
  runs in the burst with nothing stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import psutil

from bench import seed
from bench.api_client import ApiProcess, team_token
from bench.chimes_runs import Fleet, FleetShape
from bench.env import Env
from bench.procs import CpuMeter, Proc, free_port
from bench.report import Result, percentiles
from bench.target import TargetProcess
from chimes.api.app import API_POOL
from chimes.cli.roles import SCHEDULER_POOL, WORKER_POOL
from chimes.ids import PARTITION_COUNT, partition_of
from chimes.services.jobs import first_fire
from chimes.store import db
from chimes.store.bulk import Rows, copy_rows, job_rows
from chimes.store.embedded import EmbeddedPostgres
from chimes.store.migrate import migrate
from chimes.store.shards import ShardMap, add_shard, load_map

Say = Callable[[str], None]

# Each role's pool, per home, as the roles open them (the API: create_app's pool_size). The design's bound
# is (shards + 1) x this per process, the catalog counted among the homes here, plus a worker's LISTEN
# connection and its claims' connection per home (docs/scaling.md).
POOL_SIZES = {"scheduler": SCHEDULER_POOL, "worker": WORKER_POOL, "api": API_POOL}
OUTSIDE_THE_POOL = {"scheduler": 0, "worker": 2, "api": 0}  # a worker's LISTEN and claims connections, per home
SAMPLE_EVERY_SEC = 1.0
WARM_UP_REQUESTS = 20  # not counted: the API's first requests open its pools, one per shard
ACTIVITY = """
SELECT client_port FROM pg_stat_activity
WHERE backend_type = 'client backend' AND datname = $1 AND client_port IS NOT NULL
"""
RUNS = """
SELECT run_id::text AS run_id, extract(epoch FROM fired_at - scheduled_at) AS fire_lag,
       extract(epoch FROM finished_at) AS finished
FROM runs WHERE owner = 'bench'
"""


def parse_counts(text: str) -> list[int]:
    """``1,2,4`` as [1, 2, 4]: each 1 to 16, no repeats."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"comma-separated numbers of shards, e.g. 1,2,4, not {text!r}") from None
    if not counts or any(not 1 <= n <= 16 for n in counts) or len(set(counts)) != len(counts):
        raise ValueError(f"numbers of shards each from 1 to 16, none twice, e.g. 1,2,4, not {text!r}")
    return counts


def even_ranges(count: int) -> list[tuple[int, int]]:
    """The 1,024 partitions in ``count`` ranges as even as they go, in order: the catalog's first."""
    bounds = [round(i * PARTITION_COUNT / count) for i in range(count + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(count)]


# --- the servers -----------------------------------------------------------------------------------

@dataclass
class Server:
    """An embedded PostgreSQL listening on 127.0.0.1:``port`` (and on its socket)."""

    name: str  # pg1 (the catalog), pg2, ...
    embedded: EmbeddedPostgres
    port: int
    stopped: list[psutil.Process] = field(default_factory=list)

    def dsn(self, database: str) -> str:
        password = self.embedded.password_file.read_text().strip()
        return f"postgresql://postgres:{password}@127.0.0.1:{self.port}/{database}"

    def postmaster_pid(self) -> int | None:
        pid_file = self.embedded.pgdata / "postmaster.pid"
        return int(pid_file.read_text().split()[0]) if pid_file.exists() else None

    def pause(self) -> None:
        """SIGSTOP the postmaster and every process of the server: it answers nothing until :meth:`resume`."""
        pid = self.postmaster_pid()
        if pid is None:
            raise RuntimeError(f"{self.name} is not running")
        main = psutil.Process(pid)
        for proc in [main, *main.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGSTOP)
                self.stopped.append(proc)

    def resume(self) -> None:
        for proc in reversed(self.stopped):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGCONT)
        self.stopped = []


def _start_server(folder: Path, name: str) -> Server:
    embedded = EmbeddedPostgres(folder)
    embedded.acquire()
    server = Server(name, embedded, free_port())
    with (embedded.pgdata / "postgresql.conf").open("a") as conf:
        conf.write(f"# bench shards: reached over TCP, each backend's client port names its process\n"
                   f"listen_addresses = '127.0.0.1'\nport = {server.port}\n")
    embedded.stop()
    embedded.acquire()
    return server


@contextlib.contextmanager
def servers(workdir: Path, count: int, say: Say) -> Iterator[list[Server]]:
    started: list[Server] = []
    try:
        for i in range(count):
            started.append(_start_server(workdir / f"pg{i + 1}", f"pg{i + 1}"))
            say(f"shards: PostgreSQL server pg{i + 1} on 127.0.0.1:{started[-1].port}")
        yield started
    finally:
        for server in started:
            server.resume()
            server.embedded.release()


# --- one configuration -----------------------------------------------------------------------------

@dataclass
class Layout:
    """One configuration: the first ``len(servers)`` servers, a database of the same name on each, the map."""

    servers: list[Server]
    database: str
    shard_map: ShardMap

    @property
    def dsns(self) -> list[str]:
        return [s.dsn(self.database) for s in self.servers]

    @property
    def catalog_dsn(self) -> str:
        return self.dsns[0]

    def home_of(self, partition: int) -> int:
        """The index of the server holding ``partition`` (0: the catalog)."""
        shard_range = self.shard_map.range_of(partition)
        return 0 if shard_range is None else self.dsns.index(shard_range.url)

    def server_pids(self) -> dict[str, int | None]:
        return {s.name: s.postmaster_pid() for s in self.servers}


async def prepare(env: Env, all_servers: Sequence[Server], count: int, say: Say,
                  database: str | None = None) -> Layout:
    """Fresh databases on the first ``count`` servers, the catalog migrated, and each other server added
    as ``chimes shards add`` adds it (migrated, then its even share of the partitions in the map)."""
    name = database or env.database("shards")
    chosen = list(all_servers[:count])
    for server in chosen:
        admin = await asyncpg.connect(server.dsn("postgres"))
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            await admin.execute(f'CREATE DATABASE "{name}"')
            with contextlib.suppress(asyncpg.PostgresError):  # the WAL breakdown; not needed for the figures
                await admin.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        finally:
            await admin.close()
    catalog = await asyncpg.connect(chosen[0].dsn(name))
    try:
        await migrate(catalog)
    finally:
        await catalog.close()
    ranges = even_ranges(count)
    catalog = await db.connect(chosen[0].dsn(name))
    try:
        for server, (first, last) in zip(chosen[1:], ranges[1:], strict=True):
            await add_shard(catalog, server.dsn(name), first, last)  # what `chimes shards add` does
        shard_map = await load_map(catalog)
    finally:
        await catalog.close()
    layout = Layout(chosen, name, shard_map)
    held = [(r.first, r.last) for r in shard_map.ranges]
    if held != ranges[1:] or shard_map.urls() != layout.dsns[1:]:
        raise RuntimeError(f"the shard map is not the one asked for: {held}, wanted {ranges[1:]}")
    say(f"{count} shard{'s' * (count > 1)}: " + ", ".join(
        f"{s.name} {first}-{last}" for s, (first, last) in zip(chosen, ranges, strict=True)))
    return layout


# --- connections held, sampled during a measurement ------------------------------------------------

class ConnectionSampler:
    """The most connections each process held on each server's database at once, from ``pg_stat_activity``
    every second, each backend tied to its process by its client port. Backends of other processes
    (this benchmark's own) are counted as ``other``."""

    def __init__(self, layout: Layout, pools: Sequence[asyncpg.Pool], procs: Sequence[Proc]) -> None:
        self.layout = layout
        self.pools = list(pools)
        self.names = {p.pid: p.name for p in procs}
        self.most: dict[str, dict[str, int]] = {}  # process -> server -> connections
        self.most_total: dict[str, int] = {}  # process -> all servers together
        self.samples = 0
        self.paused: set[int] = set()  # indexes of servers not to ask (stopped)
        self.lock = asyncio.Lock()  # held by a sample: a server is stopped between samples, not during one
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(SAMPLE_EVERY_SEC)

    async def sample(self) -> None:
        async with self.lock:
            await self._sample()

    async def _sample(self) -> None:
        owners = await asyncio.to_thread(_port_owners)
        totals: dict[str, int] = {}
        for index, (server, pool) in enumerate(zip(self.layout.servers, self.pools, strict=True)):
            if index in self.paused:
                continue
            try:
                ports = [r[0] for r in await asyncio.wait_for(pool.fetch(ACTIVITY, self.layout.database), 2.0)]
            except (TimeoutError, *db.DB_ERRORS):
                continue
            counts: dict[str, int] = {}
            for port in ports:
                name = self.names.get(owners.get(port, -1), "other")
                counts[name] = counts.get(name, 0) + 1
            for name, n in counts.items():
                mine = self.most.setdefault(name, {})
                mine[server.name] = max(mine.get(server.name, 0), n)
                totals[name] = totals.get(name, 0) + n
        for name, n in totals.items():
            self.most_total[name] = max(self.most_total.get(name, 0), n)
        self.samples += 1

    def report(self) -> dict[str, Any]:
        homes = len(self.layout.servers)
        found: dict[str, Any] = {}
        for name in sorted(self.most):
            role = "scheduler" if name.startswith("scheduler") else "worker" if name.startswith("worker") \
                else "api" if name.startswith("api") else None
            found[name] = {"by_server": self.most[name], "most_at_once": self.most_total.get(name, 0),
                           "bound": homes * (POOL_SIZES[role] + OUTSIDE_THE_POOL[role]) if role else None}
        return {"samples": self.samples, "by_process": found}


def _port_owners() -> dict[int, int]:
    """Local TCP port -> pid, for every TCP socket of this machine that psutil can see."""
    return {c.laddr.port: c.pid for c in psutil.net_connections(kind="tcp") if c.pid is not None and c.laddr}


@dataclass
class ShardResult(Result):
    """A burst's figures, with each server's runs' start lags kept for the blast radius (not in the JSON)."""

    lags_by_server: list[list[float]] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        data = super().to_json()
        data.pop("lags_by_server")
        return data


# --- the burst -------------------------------------------------------------------------------------

async def _wait(condition: Callable[[], Awaitable[bool]], limit_sec: float, what: str, procs: Sequence[Proc]) -> None:
    deadline = time.monotonic() + limit_sec
    while not await condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {limit_sec:.0f} s waiting for {what}")
        dead = [p for p in procs if not p.alive()]
        if dead:
            raise RuntimeError(f"{dead[0].name} exited:\n{dead[0].log_tail()}")
        await asyncio.sleep(0.25)


async def _fleet_ready(fleet: Fleet, pools: Sequence[asyncpg.Pool], shape: FleetShape) -> None:
    """On every home, all 1,024 partitions leased and every worker registered."""
    async def ready() -> bool:
        for pool in pools:
            leased = await pool.fetchval(
                "SELECT count(*) FROM partition_leases WHERE owner IS NOT NULL AND expires_at > now()")
            workers = await pool.fetchval("SELECT count(*) FROM workers")
            if leased != PARTITION_COUNT or workers != shape.workers:
                return False
        return True

    await _wait(ready, 60, "the fleet to lease every partition of every home", fleet.procs)


async def _seed(layout: Layout, pools: Sequence[asyncpg.Pool], spec: seed.JobSpec, runs: int) -> list[int]:
    """``runs`` copies of ``spec``, each in its home by its partition (one transaction per home, all at
    once); how many each home got."""
    now = datetime.now(UTC)
    rows = job_rows([spec] * runs, "bench", now, first_fire)
    trigger_of = {t[3]: t for t in rows.triggers}  # by job id
    jobs: list[list[tuple[Any, ...]]] = [[] for _ in pools]
    for job in rows.jobs:
        jobs[layout.home_of(partition_of(uuid.UUID(job[0])))].append(job)

    async def copy(pool: asyncpg.Pool, home: int) -> None:
        async with pool.acquire() as conn, conn.transaction():
            for first in range(0, len(jobs[home]), seed.CHUNK):
                chunk = jobs[home][first:first + seed.CHUNK]
                await copy_rows(conn, Rows(chunk, [trigger_of[j[0]] for j in chunk if j[0] in trigger_of]))

    await asyncio.gather(*(copy(pool, home) for home, pool in enumerate(pools)))
    return [len(j) for j in jobs]


async def _succeeded(pool: asyncpg.Pool) -> int:
    return await pool.fetchval("SELECT count(*) FROM runs WHERE owner = 'bench' AND status = 'succeeded'")


async def burst(env: Env, target: TargetProcess, layout: Layout, *, runs: int, shape: FleetShape, say: Say,
                label: str, pause_last: bool = False) -> ShardResult:
    """The burst over ``layout``; with ``pause_last``, the last server is stopped at the due second until
    every run of the others has succeeded."""
    await target.reset()
    fleet = Fleet(env, layout.catalog_dsn, shape, label.replace(" ", "-").replace(",", ""))
    pools = [await db.create_pool(dsn, min_size=1, max_size=3) for dsn in layout.dsns]
    sampler = ConnectionSampler(layout, pools, fleet.procs)
    paused = layout.servers[-1] if pause_last else None
    stopped_sec = None
    try:
        await _fleet_ready(fleet, pools, shape)
        due = seed.due_instant(3.0 + runs / 10_000)
        spec = seed.http_job("burst", seed.at(due), f"{target.url}/r", concurrency="allow")
        started = time.perf_counter()
        per_home = await _seed(layout, pools, spec, runs)
        say(f"{label}: {runs:,} jobs created in {time.perf_counter() - started:.1f}s "
            f"({', '.join(f'{s.name} {n:,}' for s, n in zip(layout.servers, per_home, strict=True))}), "
            f"due at {due:%H:%M:%S}")
        if datetime.now(UTC) > due - timedelta(seconds=1):
            raise RuntimeError("creating the jobs took longer than the lead time")
        meter = CpuMeter(fleet.procs, layout.server_pids())
        meter.start()
        wal_start = [await pool.fetchval("SELECT pg_current_wal_lsn()") for pool in pools]
        sampler.start()
        limit = 120 + runs / 200
        if paused is not None:
            await asyncio.sleep(max(0.0, due.timestamp() - time.time()))
            async with sampler.lock:
                sampler.paused.add(len(pools) - 1)
                paused.pause()
            stopped_at = time.monotonic()
            say(f"{label}: {paused.name} stopped (SIGSTOP) at the due second")
            healthy = pools[:-1]
            expected = sum(per_home[:-1])

            async def healthy_done() -> bool:
                return sum([await _succeeded(pool) for pool in healthy]) >= expected

            await _wait(healthy_done, limit, "every run of the healthy shards to succeed", fleet.procs)
            paused.resume()
            sampler.paused.clear()
            stopped_sec = time.monotonic() - stopped_at
            say(f"{label}: {paused.name} let go (SIGCONT) after {stopped_sec:.1f}s")

        async def all_done() -> bool:
            return sum([await _succeeded(pool) for pool in pools]) >= runs

        await _wait(all_done, limit, "every run to succeed", fleet.procs)
        cpu = meter.stop()
        await sampler.stop()
        wal_end = [await pool.fetchval("SELECT pg_current_wal_lsn()") for pool in pools]
        wal_bytes = [float(await pool.fetchval("SELECT pg_wal_lsn_diff($2::pg_lsn, $1::pg_lsn)", a, b))
                     for pool, a, b in zip(pools, wal_start, wal_end, strict=True)]
        homes_rows = [await pool.fetch(RUNS) for pool in pools]
        times, keys = await target.arrivals()
    finally:
        if paused is not None:
            paused.resume()
        await sampler.stop()
        for pool in pools:
            await pool.close()
        fleet.stop()
    return _burst_result(label, layout, runs, due, homes_rows, times, keys, cpu, wal_bytes, sampler, fleet,
                         stopped_sec)


def _burst_result(label: str, layout: Layout, runs: int, due: datetime, homes_rows: list[list[asyncpg.Record]],
                  times: list[float], keys: list[str], cpu: dict[str, float], wal_bytes: list[float],
                  sampler: ConnectionSampler, fleet: Fleet, stopped_sec: float | None) -> ShardResult:
    t0 = due.timestamp()
    home_of_run = {r["run_id"]: home for home, rows in enumerate(homes_rows) for r in rows}
    lags: list[list[float]] = [[] for _ in homes_rows]
    for when, key in zip(times, keys, strict=True):
        home = home_of_run.get(key)
        if home is not None:
            lags[home].append(when - t0)
    every = [lag for mine in lags for lag in mine]
    fire = [float(r["fire_lag"]) for rows in homes_rows for r in rows if r["fire_lag"] is not None]
    finished = [float(r["finished"]) for rows in homes_rows for r in rows if r["finished"] is not None]
    result = ShardResult(label, "shards", runs, len(finished), (max(finished) - t0) if finished else None,
                         fire_lag=percentiles(fire), start_lag=percentiles(every), cpu_sec=cpu,
                         peak_mb=fleet.peaks(), start_lags=every, lags_by_server=lags)
    result.extra = {
        "shards": len(layout.servers), "fleet": vars(fleet.shape), "calls": len(times),
        "distinct_calls": len(set(keys)), "warnings": fleet.warnings(),
        "by_server": [{"server": s.name, "partitions": _partitions_of(layout, i), "runs": len(homes_rows[i]),
                       "start_lag": percentiles(lags[i]),
                       "wal_bytes": round(wal_bytes[i]),
                       "wal_bytes_per_run": round(wal_bytes[i] / len(homes_rows[i])) if homes_rows[i] else None}
                      for i, s in enumerate(layout.servers)],
        "wal_bytes_per_run": round(sum(wal_bytes) / runs),
        "connections": sampler.report(),
    }
    if stopped_sec is not None:
        result.extra["stopped"] = {"server": layout.servers[-1].name, "seconds": round(stopped_sec, 2)}
    return result


def _partitions_of(layout: Layout, index: int) -> str:
    first, last = even_ranges(len(layout.servers))[index]
    return f"{first}-{last}"


# --- the API's routing -----------------------------------------------------------------------------

class _Api:
    """One ``chimes api`` process on one configuration, with a client holding a team token."""

    def __init__(self, env: Env, layout: Layout) -> None:
        self.layout = layout
        self.label = f"API, {_label(len(layout.servers))}"
        self.process = ApiProcess(layout.catalog_dsn, env.workdir, name=f"api-{len(layout.servers)}")
        self.client: httpx.AsyncClient | None = None
        self.numbers = iter(range(1_000_000))

    async def open(self) -> None:
        token = await team_token(self.layout.catalog_dsn)
        self.client = httpx.AsyncClient(base_url=self.process.url, headers={"Authorization": f"Bearer {token}"},
                                        timeout=30)
        await self.process.ready(self.client)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        self.process.stop()

    async def create(self, due: str) -> str:
        assert self.client is not None
        answer = await self.client.post("/jobs", json={
            "name": f"create-{next(self.numbers)}", "schedule": {"at": due},
            "task": {"type": "http", "url": "http://127.0.0.1:9/never"}})
        if answer.status_code != 201:
            raise RuntimeError(f"{self.label}: POST /jobs answered {answer.status_code}: {answer.text[:500]}")
        return str(answer.json()["jobId"])

    async def read(self, job_id: str) -> str:
        assert self.client is not None
        answer = await self.client.get(f"/jobs/{job_id}")
        if answer.status_code != 200:
            raise RuntimeError(f"{self.label}: GET /jobs/{job_id} answered {answer.status_code}: {answer.text[:500]}")
        return job_id


async def api_routing(env: Env, layouts: Sequence[Layout], *, creates: int, say: Say) -> list[Result]:
    """A ``chimes api`` per configuration, all at once, each on its own databases. First each alone, one
    after the other, for CPU: ``creates`` jobs created one at a time (due in an hour: none fires), then
    each read back with ``GET /jobs/{id}``, the API's CPU and every server's counted. Then the latency
    side by side: as many creates and reads again, taking turns request by request (the first to go
    alternating), so that a change in the machine's load falls on every configuration alike."""
    apis = [_Api(env, layout) for layout in layouts]
    figures: list[dict[str, Any]] = [{} for _ in apis]
    samplers: list[ConnectionSampler] = []
    pools: list[asyncpg.Pool] = []
    try:
        for api in apis:
            await api.open()
        due = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        for api in apis:  # not counted: the first requests open each API's pools, one per shard
            for job_id in [await api.create(due) for _ in range(WARM_UP_REQUESTS)]:
                await api.read(job_id)
        for api, mine in zip(apis, figures, strict=True):
            api_pools = [await db.create_pool(dsn, min_size=1, max_size=2) for dsn in api.layout.dsns]
            pools += api_pools
            samplers.append(ConnectionSampler(api.layout, api_pools, [api.process.proc]))
            created: list[str] = []
            mine["create"] = await _cpu_of(api, [lambda a=api: a.create(due)] * creates, created)
            mine["get"] = await _cpu_of(api, [lambda a=api, j=j: a.read(j) for j in created], [])
            await samplers[-1].sample()
        turns: list[list[str]] = [[] for _ in apis]
        create_lags: list[list[tuple[str, float]]] = [[] for _ in apis]
        get_lags: list[list[tuple[str, float]]] = [[] for _ in apis]
        for i in range(creates):
            for k in _turn_order(len(apis), i):
                job_id, took = await _clocked(apis[k].create(due))
                turns[k].append(job_id)
                create_lags[k].append((job_id, took))
        for i in range(creates):
            for k in _turn_order(len(apis), i):
                job_id, took = await _clocked(apis[k].read(turns[k][i]))
                get_lags[k].append((job_id, took))
        homes = [[await pool.fetchval("SELECT count(*) FROM jobs WHERE owner = 'team'") for pool in api_pools]
                 for api_pools in _split(pools, [len(a.layout.servers) for a in apis])]
    finally:
        for sampler in samplers:
            await sampler.stop()
        for pool in pools:
            await pool.close()
        for api in apis:
            await api.close()
    results = []
    for k, api in enumerate(apis):
        expected = WARM_UP_REQUESTS + 2 * creates
        if sum(homes[k]) != expected:
            raise RuntimeError(f"{api.label}: {sum(homes[k])} jobs found on the servers, {expected} created")
        for what, lags in (("create", create_lags[k]), ("get", get_lags[k])):
            figures[k][what] |= _latencies(api.layout, lags)
        say(f"{api.label}: create p50 {figures[k]['create']['latency_ms']['p50']:.1f} ms, "
            f"GET p50 {figures[k]['get']['latency_ms']['p50']:.1f} ms (side by side)")
        result = Result(api.label, "shards-api", creates, creates, None,
                        peak_mb={"api": round(api.process.proc.peak_rss_mb(), 1)})
        result.extra = {"shards": len(api.layout.servers), **figures[k], "jobs_by_server": homes[k],
                        "connections": samplers[k].report()}
        results.append(result)
    return results


def _turn_order(count: int, i: int) -> list[int]:
    """Whose turn first in round ``i``: the configurations in order, then the other way round."""
    order = list(range(count))
    return order if i % 2 == 0 else order[::-1]


def _split(items: Sequence[asyncpg.Pool], sizes: Sequence[int]) -> list[list[asyncpg.Pool]]:
    out, start = [], 0
    for size in sizes:
        out.append(list(items[start:start + size]))
        start += size
    return out


async def _clocked(call: Awaitable[str]) -> tuple[str, float]:
    started = time.perf_counter()
    job_id = await call
    return job_id, (time.perf_counter() - started) * 1000


def _latencies(layout: Layout, lags: Sequence[tuple[str, float]]) -> dict[str, Any]:
    """Latency percentiles (ms), of all requests and by the server holding each request's job."""
    by_home: list[list[float]] = [[] for _ in layout.servers]
    for job_id, took in lags:
        by_home[layout.home_of(partition_of(uuid.UUID(job_id)))].append(took)
    return {"latency_ms": percentiles([took for _, took in lags]),
            "latency_ms_by_job_server": {s.name: percentiles(mine)
                                         for s, mine in zip(layout.servers, by_home, strict=True)}}


async def _cpu_of(api: _Api, calls: Sequence[Callable[[], Awaitable[str]]], keep: list[str]) -> dict[str, Any]:
    """Each call one after the other, this API alone: CPU ms per call of the API and of the servers (all
    together and each), and the latency alone (ms)."""
    meter = CpuMeter([api.process.proc], api.layout.server_pids())
    meter.start()
    alone = []
    for call in calls:
        job_id, took = await _clocked(call())
        keep.append(job_id)
        alone.append(took)
    cpu = meter.stop()
    n = len(calls)
    servers = {s.name: round(cpu.get(s.name, 0.0) / n * 1000, 4) for s in api.layout.servers}
    return {"requests": n, "latency_alone_ms": percentiles(alone),
            "cpu_ms": {"api": round(cpu.get(api.process.proc.name, 0.0) / n * 1000, 4),
                       "postgresql": round(sum(servers.values()), 4), "by_server": servers}}


# --- the scenario ----------------------------------------------------------------------------------

async def shards(env: Env, target: TargetProcess, *, runs: int, counts: Sequence[int], creates: int,
                 shape: FleetShape, say: Say) -> list[Result]:
    """Every configuration of ``counts`` (the burst; the API for the first and the last), then the
    blast radius on the largest with 2 or more shards."""
    results: list[Result] = []
    api_counts = sorted({min(counts), max(counts)})
    blast = max((n for n in counts if n >= 2), default=None)
    with servers(env.workdir, max(counts), say) as started:
        for count in counts:
            layout = await prepare(env, started, count, say)
            results.append(await burst(env, target, layout, runs=runs, shape=shape, say=say,
                                       label=_label(count)))
        if creates:
            layouts = [await prepare(env, started, count, say, database=env.database(f"api{count}"))
                       for count in api_counts]
            results += await api_routing(env, layouts, creates=creates, say=say)
        if blast is not None:
            layout = await prepare(env, started, blast, say)
            results.append(await burst(env, target, layout, runs=runs, shape=shape, say=say,
                                       label=f"{_label(blast)}, {layout.servers[-1].name} stopped", pause_last=True))
            results[-1].extra["blast_radius"] = blast_radius(results)
    return results


def _label(count: int) -> str:
    return f"{count} shard{'s' * (count > 1)}"


# --- the report ------------------------------------------------------------------------------------

def _group(name: str) -> str:
    return "scheduler" if name.startswith("scheduler") else "workers" if name.startswith("worker") \
        else "api" if name.startswith("api") else "postgresql" if name.startswith("pg") else name


def cpu_ms_per_run(result: Result) -> dict[str, float]:
    """CPU ms per run: scheduler, workers, each server (pg1, pg2...) and their sum (postgresql)."""
    if not result.completed:
        return {}
    found: dict[str, float] = {}
    for name, seconds in result.cpu_sec.items():
        group = _group(name)
        if group == "postgresql":
            found[name] = round(seconds / result.completed * 1000, 4)
        found[group] = found.get(group, 0.0) + seconds / result.completed * 1000
    return {k: round(v, 4) for k, v in found.items()}


def blast_radius(results: Sequence[Result]) -> dict[str, Any] | None:
    """The healthy shards' start lag with one stopped, next to the same shards' in the burst with none
    stopped; None when the scenario had no stopped shard."""
    bursts = [r for r in results if isinstance(r, ShardResult)]
    stalled = next((r for r in bursts if "stopped" in r.extra), None)
    if stalled is None:
        return None
    base = next((r for r in bursts if "stopped" not in r.extra and r.extra["shards"] == stalled.extra["shards"]), None)
    if base is None:
        return None

    def healthy(r: ShardResult) -> dict[str, float] | None:
        return percentiles([lag for lags in r.lags_by_server[:-1] for lag in lags])

    with_stop, without = healthy(stalled), healthy(base)
    ratio = None if not (with_stop and without and without["p99"]) else round(with_stop["p99"] / without["p99"], 2)
    return {"shards": stalled.extra["shards"], "stopped": stalled.extra["stopped"],
            "healthy_start_lag_nothing_stopped": without, "healthy_start_lag_one_stopped": with_stop,
            "healthy_p99_ratio": ratio, "stopped_shard_start_lag": stalled.extra["by_server"][-1]["start_lag"]}


def _lag(summary: dict[str, float] | None) -> str:
    return "-" if summary is None else f"{summary['p50']:.2f} / {summary['p99']:.2f}"


def _grid(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    return [" | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)), "-+-".join("-" * w for w in widths),
            *(" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows)]


def shards_table(results: Sequence[Result]) -> str:
    bursts = [r for r in results if r.scenario == "shards"]
    lines = _grid(["configuration", "runs", "runs/s", "start lag p50 / p99 s",
                   "CPU ms/run: scheduler, workers, PostgreSQL (each server) = total", "WAL B/run (each server)"],
                  [[r.system, f"{r.completed:,}/{r.runs:,}", "-" if r.throughput is None else f"{r.throughput:,.0f}",
                    _lag(r.start_lag), _cpu_cell(r), _wal_cell(r)] for r in bursts])
    for r in bursts:
        lines.append(f"  {r.system}: start lag p50 / p99 by server: " + ", ".join(
            f"{s['server']} ({s['partitions']}, {s['runs']:,} runs) {_lag(s['start_lag'])}"
            for s in r.extra["by_server"]))
        lines.append(f"  {r.system}: connections held at most (by server; all servers at once / the bound): "
                     + _connections_cell(r))
    apis = [r for r in results if r.scenario == "shards-api"]
    if apis:
        lines.append("")
        lines += _grid(["API", "create p50 / p99 ms", "create CPU ms: API, PostgreSQL", "GET /jobs/{id} p50 / p99 ms",
                        "GET CPU ms: API, PostgreSQL", "connections held (by server)"],
                       [[r.system, _ms(r.extra["create"]), _cpu_req(r.extra["create"]), _ms(r.extra["get"]),
                         _cpu_req(r.extra["get"]), _connections_cell(r)] for r in apis])
        for r in apis:
            if r.extra["shards"] > 1:
                lines.append(f"  {r.system}: p50 / p99 ms by the server holding the job: create " + ", ".join(
                    f"{k} {_ms({'latency_ms': v})}" for k, v in r.extra["create"]["latency_ms_by_job_server"].items()
                    if v) + "; GET " + ", ".join(
                    f"{k} {_ms({'latency_ms': v})}" for k, v in r.extra["get"]["latency_ms_by_job_server"].items()
                    if v))
        if len(apis) > 1:
            first, last = apis[0].extra, apis[-1].extra
            lines.append(f"  {apis[-1].system} against {apis[0].system}: create p50 "
                         f"x{_ratio(last['create']['latency_ms']['p50'], first['create']['latency_ms']['p50'])}, "
                         f"GET p50 x{_ratio(last['get']['latency_ms']['p50'], first['get']['latency_ms']['p50'])}, "
                         f"create CPU x{_ratio(_cpu_sum(last['create']), _cpu_sum(first['create']))}, "
                         f"GET CPU x{_ratio(_cpu_sum(last['get']), _cpu_sum(first['get']))}")
    blast = blast_radius(results)
    if blast is not None:
        lines.append("")
        lines.append(f"blast radius, {blast['shards']} shards, {blast['stopped']['server']} stopped for "
                     f"{blast['stopped']['seconds']:.1f}s: the other shards' start lag p50 / p99 "
                     f"{_lag(blast['healthy_start_lag_one_stopped'])} s against "
                     f"{_lag(blast['healthy_start_lag_nothing_stopped'])} s with nothing stopped "
                     f"(p99 x{blast['healthy_p99_ratio']}); the stopped shard's runs "
                     f"{_lag(blast['stopped_shard_start_lag'])} s")
    return "\n".join(lines)


def _cpu_cell(r: Result) -> str:
    cpu = cpu_ms_per_run(r)
    servers = ", ".join(f"{k} {v:.3f}" for k, v in cpu.items() if k.startswith("pg"))
    total = cpu.get("scheduler", 0.0) + cpu.get("workers", 0.0) + cpu.get("postgresql", 0.0)
    return (f"{cpu.get('scheduler', 0.0):.3f}, {cpu.get('workers', 0.0):.3f}, {cpu.get('postgresql', 0.0):.3f} "
            f"({servers}) = {total:.3f}")


def _wal_cell(r: Result) -> str:
    return f"{r.extra['wal_bytes_per_run']:,} (" + ", ".join(
        f"{s['server']} {s['wal_bytes_per_run']:,}" if s["wal_bytes_per_run"] is not None else f"{s['server']} -"
        for s in r.extra["by_server"]) + ")"


def _connections_cell(r: Result) -> str:
    found = r.extra["connections"]["by_process"]
    parts = []
    for name, held in found.items():
        by_server = ", ".join(f"{k} {v}" for k, v in sorted(held["by_server"].items()))
        bound = "" if held["bound"] is None else f" / {held['bound']}" + (
            " OVER" if held["most_at_once"] > held["bound"] else "")
        parts.append(f"{name}: {by_server}; {held['most_at_once']}{bound}")
    return "; ".join(parts) or "-"


def _ms(figures: dict[str, Any]) -> str:
    lat = figures["latency_ms"]
    return f"{lat['p50']:.1f} / {lat['p99']:.1f}"


def _cpu_req(figures: dict[str, Any]) -> str:
    return f"{figures['cpu_ms']['api']:.3f}, {figures['cpu_ms']['postgresql']:.3f}"


def _cpu_sum(figures: dict[str, Any]) -> float:
    return float(figures["cpu_ms"]["api"] + figures["cpu_ms"]["postgresql"])


def _ratio(a: float, b: float) -> str:
    return "-" if not b else f"{a / b:.2f}"
