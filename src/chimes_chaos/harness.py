"""A chaos run from start to end: start the fleet, load the workload, inject faults, heal, check.

Phases: the fleet starts (its own PostgreSQL unless a URL is given, the roles as real processes) and
the workload is created through the API; faults are injected for ``duration`` seconds while one-off
jobs keep being created; then every process is brought back and the fleet runs healthy for a while;
the jobs are paused, the remaining runs are left to finish, and the invariants are checked.

With ``shards`` N > 1 the harness starts N servers and gives N-1 of them an even share of the
partitions (``chimes shards add``) before any role starts; the checks read every home. With ``moves``
as well, ranges of partitions move between homes during the fault phase (chimes_chaos.moves); every
move under way is taken to its end before the fleet settles, and the checks read each row on the home
the final map gives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from chimes.ids import PARTITION_COUNT
from chimes.store.db import one_row
from chimes.store.migrate import migrate
from chimes.store.shards import add_shard, load_map
from chimes.store.tokens import create_token
from chimes_chaos.evidence import Evidence, Placement, jobs_found, read_database, unfinished_count
from chimes_chaos.faults import FaultRunner, FaultWindow, plan_faults
from chimes_chaos.fleet import Fleet, FleetShape
from chimes_chaos.invariants import check_all
from chimes_chaos.moves import MoveRunner
from chimes_chaos.observer import LeaseObserver
from chimes_chaos.report import Report
from chimes_chaos.target import ChaosTarget
from chimes_chaos.workload import (
    OWNER,
    Answers,
    ChaosJob,
    WriteProbe,
    create_job,
    make_one_offs,
    probe_job,
    probe_number,
    recurring_jobs,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ChaosOptions:
    duration: float = 120.0  # seconds of fault injection
    seed: int = 7
    database_url: str | None = None  # default: the harness's own embedded PostgreSQL (restartable)
    ha: bool = False  # a Patroni cluster of its own instead, whose primary the faults kill, freeze and move
    zones: bool = False  # that cluster and the fleet in three zones (network namespaces), which the faults cut off
    zone_clock_skew: float = 2.0  # with zones: zone 3's processes run this many seconds ahead (behind if < 0)
    jobs: int = 40
    shards: int = 1  # databases: the catalog and shards - 1 shard servers, each with an even share of partitions
    moves: bool = False  # with shards > 1: ranges of partitions moved back and forth between homes meanwhile
    fault_every: float = 4.0  # mean seconds between faults
    one_off_every: float = 5.0
    shape: FleetShape = field(default_factory=FleetShape)
    work_dir: Path | None = None  # default: a temporary folder, removed after a clean run
    drain_timeout: float = 120.0

    @property
    def settle_sec(self) -> float:
        """Healthy running after the faults, so the last slots are fired by a fleet at rest."""
        return self.shape.lease_ttl + self.shape.worker_lease + 5.0

    def command(self) -> str:
        args = ["chimes", "chaos", "--duration", f"{self.duration:g}", "--seed", str(self.seed),
                "--jobs", str(self.jobs), "--fault-every", f"{self.fault_every:g}"]
        if self.database_url:
            args += ["--database-url", "URL"]
        if self.shards > 1:
            args += ["--shards", str(self.shards)]
        if self.moves:
            args += ["--moves"]
        if self.zones:
            args += ["--zones", "--zone-clock-skew", f"{self.zone_clock_skew:g}"]
        elif self.ha:
            args += ["--ha"]
        return shlex.join(args)


async def run_chaos(options: ChaosOptions) -> Report:
    if options.moves and options.shards < 2:
        raise ValueError("moves need two homes at least (shards >= 2)")
    began = time.monotonic()
    work_dir = options.work_dir or Path(tempfile.mkdtemp(prefix="chimes-chaos-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(work_dir, options.shape, options.database_url, ha=options.ha, zones=options.zones,
                  zone_clock_skew=options.zone_clock_skew, shards=options.shards)
    target = ChaosTarget(work_dir / "deliveries.jsonl", options.seed, fleet.target_host)
    report: Report | None = None
    try:
        await asyncio.to_thread(fleet.start_database)
        token = await _prepare_database(fleet.dsn)
        await _add_shards(fleet)  # before the roles start: they read the map once, at start
        await target.start()
        fleet.start_roles()
        # Longer than the API's own request timeout (15 s): a write it cannot finish gets its 503, not silence.
        async with httpx.AsyncClient(base_url=fleet.api_url, timeout=25,
                                     headers={"Authorization": f"Bearer {token}"}) as api:
            await _until(lambda: _ready(fleet, api), 90, "the fleet to start", fleet)
            report = await _run(options, fleet, target, api, work_dir)
        report.wall_sec = time.monotonic() - began
        return report
    finally:
        await asyncio.to_thread(fleet.stop)
        await target.stop()
        if report is not None and report.ok and options.work_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)


async def _run(options: ChaosOptions, fleet: Fleet, target: ChaosTarget, api: httpx.AsyncClient,
               work_dir: Path) -> Report:
    loop = asyncio.get_running_loop()
    answers = Answers()
    jobs = [await create_job(api, body, f"chaos-{options.seed}-{body['name']}", loop.time() + 30, answers)
            for body in recurring_jobs(options.seed, options.jobs, target.url)]
    probe = WriteProbe((await create_job(api, probe_job(target.url), f"chaos-{options.seed}-probe",
                                         loop.time() + 30, answers)).job_id, answers)
    plan = plan_faults(options.seed, options.duration, schedulers=fleet.schedulers, workers=fleet.workers,
                       lease_ttl=options.shape.lease_ttl, worker_lease=options.shape.worker_lease,
                       mean_gap=options.fault_every, database=fleet.postgres is not None,
                       ha=fleet.cluster is not None, zones=fleet.zones is not None, shards=len(fleet.ranges))
    log.info("chaos: %d jobs created, %d faults planned over %g s", len(jobs), len(plan), options.duration)
    # One lease observer per home, each on the partitions that home holds (all of them when they move).
    observers = [LeaseObserver(dsn, partitions=range(first, last + 1) if len(fleet.ranges) > 1 and not options.moves
                               else None, home=home)
                 for home, (dsn, (first, last)) in enumerate(zip(fleet.home_dsns, fleet.ranges, strict=True))]
    mover = MoveRunner(fleet, options.seed, work_dir / "logs") if options.moves else None
    stop = asyncio.Event()
    watchers = [*(asyncio.create_task(o.run(stop)) for o in observers), asyncio.create_task(_supervise(fleet, stop))]
    runner = FaultRunner(plan, fleet, target)
    started = datetime.now(UTC)
    async with asyncio.TaskGroup() as phase:  # one failing cancels the other
        phase.create_task(runner.run())
        phase.create_task(make_one_offs(api, target.url, options.seed, options.one_off_every,
                                        loop.time() + options.duration, jobs, answers))
        phase.create_task(probe.run(api, loop.time() + options.duration))
        if mover is not None:
            phase.create_task(mover.run(loop.time() + options.duration))
    faults_ended = datetime.now(UTC)
    check_end = await _heal_and_pause(options, fleet, api, jobs, mover)
    placement: Placement | None = {} if len(fleet.ranges) > 1 else None
    runs, attempts, unfinished, found, home_of = await _drain_and_read(
        options, fleet, [job.job_id for job in jobs], probe.job_id, placement)
    stop.set()
    await asyncio.gather(*watchers)
    observer = LeaseObserver.merged(observers) if mover is None else observers[0]
    # A crash of PostgreSQL itself is a fault too, one nobody injected: the checks must allow for it.
    crashes = [FaultWindow("postgres_crashed", None, start, end, note) for start, end, note in fleet.database_crashes()]
    evidence = Evidence({job.job_id: job for job in jobs}, runs, attempts, unfinished, list(target.deliveries),
                        runner.windows + crashes, fleet.exits, observer, options.shape, started, faults_ended,
                        check_end, answers=answers.log, jobs_found=set(found),
                        probe=(probe.acknowledged, probe_number(found.get(probe.job_id, ""))),
                        home_of=home_of, placement=placement)
    if mover is not None:
        evidence.first_home_of, evidence.moves, evidence.lease_homes = (fleet.home_of_partitions(), mover.windows,
                                                                        observers)
    violations = check_all(evidence)
    if evidence.home_of is not None:  # every home ran its share: the checks read them all
        evidence.figures["runs_by_home"] = {name: sum(1 for r in runs if evidence.home(r["partition_id"]) == home)
                                            for home, name in enumerate(fleet.home_names)}
    return Report(
        seed=options.seed, duration_sec=options.duration, wall_sec=0.0, command=options.command(),
        work_dir=str(work_dir), database=fleet.database,
        faults=dict(Counter(w.kind for w in runner.windows if not w.note)),
        faults_skipped=sum(1 for w in runner.windows if w.note), jobs=len(jobs),
        runs=dict(Counter(r["status"] for r in runs)), attempts=sum(len(a) for a in attempts.values()),
        figures=evidence.figures | _fence_figures(fleet, attempts) | {
            "lease_polls": sum(o.polls for o in observers),
            "failed_lease_polls": sum(o.failed_polls for o in observers),
        } | ({"moves": mover.figures()} if mover is not None else {}),
        exits=[asdict(e) for e in fleet.exits], violations=violations,
        database_crashes=[asdict(c) for c in crashes], fault_windows=[asdict(w) for w in runner.windows],
        move_windows=[asdict(w) for w in mover.windows] if mover is not None else [],
    )


async def _heal_and_pause(options: ChaosOptions, fleet: Fleet, api: httpx.AsyncClient,
                          jobs: list[ChaosJob], mover: MoveRunner | None) -> datetime:
    """Bring every process back, take every move under way to its end, let the fleet run unharmed,
    then pause the jobs. Returns the check horizon: every slot up to it must have fired."""
    fleet.heal()
    if mover is not None:
        await mover.finish()
    log.info("chaos: faults over; the fleet runs healthy for %g s", options.settle_sec)
    await asyncio.sleep(options.settle_sec)  # a time span to let pass, not a condition to wait for
    check_end = datetime.now(UTC) - timedelta(seconds=options.shape.lease_ttl + 2)
    for job in jobs:
        await _pause(api, job)
    return check_end


async def _drain_and_read(options: ChaosOptions, fleet: Fleet, job_ids: list[Any], probe_id: Any,
                          placement: Placement | None) -> tuple[
        list[dict[str, Any]], dict[Any, list[dict[str, Any]]], list[dict[str, Any]], dict[Any, str], list[int] | None]:
    """Let the runs still going end (a timeout is not an error: invariant 2 judges what is left);
    then read what the checks need, the jobs that exist (and the probe's) included, each on the home
    the final shard map gives it (returned too: None with one database)."""
    homes: list[asyncpg.Connection] = []
    try:
        for dsn in fleet.home_dsns:
            homes.append(await asyncpg.connect(dsn))
        await _until(lambda: _drained(homes, job_ids), options.drain_timeout, "the last runs to end", fleet,
                     fail=False)
        home_of = await _final_homes(homes[0], fleet) if len(homes) > 1 else None
        runs, attempts, unfinished = await read_database(homes, job_ids, home_of, placement)
        found = await jobs_found(homes, [*job_ids, probe_id], home_of, placement)
        return runs, attempts, unfinished, found, home_of
    finally:
        for conn in homes:
            await conn.close()


async def _final_homes(catalog: asyncpg.Connection, fleet: Fleet) -> list[int]:
    """Each partition's home (an index into ``fleet.home_dsns``) by the shard map the run ended with."""
    shard_map = await load_map(catalog)
    homes = []
    for partition in range(PARTITION_COUNT):
        held = shard_map.range_of(partition)
        homes.append(0 if held is None else fleet.home_dsns.index(held.url))
    return homes


def _fence_figures(fleet: Fleet, attempts: dict[Any, list[dict[str, Any]]]) -> dict[str, int]:
    """How often the faults made the fences work: stale writes refused, lost runs reaped."""
    return {
        "stale_outcomes_refused": fleet.count_in_logs("refused: the lease was lost"),
        "stale_fire_batches_refused": fleet.count_in_logs("fencing refused a batch"),
        "attempts_reaped": sum(1 for history in attempts.values() for a in history
                               if "stopped heartbeating" in (a["error"] or "")
                               or "ran past its deadline" in (a["error"] or "")),
    }


async def _prepare_database(dsn: str) -> str:
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
        return await create_token(conn, OWNER, name="chimes chaos")
    finally:
        await conn.close()


async def _add_shards(fleet: Fleet) -> None:
    """Give each shard server its range (``chimes shards add``); the catalog keeps the first."""
    if not fleet.shard_dsns:
        return
    conn = await asyncpg.connect(fleet.dsn)
    try:
        for url, (first, last) in zip(fleet.shard_dsns, fleet.ranges[1:], strict=True):
            await add_shard(conn, url, first, last)
    finally:
        await conn.close()


async def _ready(fleet: Fleet, api: httpx.AsyncClient) -> bool:
    """The API answers, and on every home each node holds leases, all 1,024 are held and each worker
    has registered (a node and a worker serve every home)."""
    with contextlib.suppress(httpx.TransportError):
        if (await api.get("/healthz")).status_code != 200:
            return False
        for dsn in fleet.home_dsns:
            conn = await asyncpg.connect(dsn)
            try:
                row = one_row(await conn.fetchrow(
                    "SELECT (SELECT count(DISTINCT owner) FROM partition_leases WHERE expires_at > now()) AS nodes,"
                    " (SELECT count(*) FROM partition_leases WHERE expires_at > now()) AS held,"
                    " (SELECT count(*) FROM workers) AS workers"))
            finally:
                await conn.close()
            if (row["nodes"], row["held"], row["workers"]) != (fleet.shape.schedulers, 1024, fleet.shape.workers):
                return False
        return True
    return False


async def _drained(homes: list[asyncpg.Connection], job_ids: list[Any]) -> bool:
    return await unfinished_count(homes, job_ids) == 0


async def _pause(api: httpx.AsyncClient, job: ChaosJob) -> None:
    response = await api.patch(f"/jobs/{job.job_id}", json={"paused": True})
    if response.status_code != 200:
        raise RuntimeError(f"pausing {job.name} failed: {response.status_code} {response.text}")


async def _supervise(fleet: Fleet, stop: asyncio.Event) -> None:
    while not stop.is_set():
        for gone in fleet.supervise():
            log.warning("chaos: %s exited on its own (code %s); started again", gone.member, gone.code)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=1.0)


async def _until(condition: Callable[[], Awaitable[bool]], within: float, what: str, fleet: Fleet,
                 fail: bool = True) -> None:
    deadline = time.monotonic() + within
    while not await condition():
        if time.monotonic() > deadline:
            if fail:
                tails = "\n".join(f"--- {m.name}\n{m.log_tail()}" for m in fleet.members.values())
                raise RuntimeError(f"timed out after {within:g} s waiting for {what}\n{tails}")
            log.warning("chaos: timed out after %g s waiting for %s", within, what)
            return
        await asyncio.sleep(0.2)
