"""``python -m bench move``: ``chimes shards move`` on a live fleet, over a large index of schedules.

Two embedded PostgreSQL servers of its own (as ``shards`` starts them, bench/shards.py): the catalog,
which holds all 1,024 partitions at first, and an empty database on the second server. The catalog
gets ``--schedules`` recurring jobs (hourly, daily and weekday crons, made inside PostgreSQL as
``top-of-hour``'s idle schedules are, bench/seed.py; their triggers are not due while the benchmark
runs), spread over every partition, plus a few every-second jobs (``* * * * * *``, concurrency
``allow``) calling the bench target: four in the range that moves, two outside it. A ``chimes
scheduler``, a ``chimes worker`` and a ``chimes api`` run on the catalog. When every every-second
job has been called a few times, a client starts changing a job of the moving range through the API
(``PATCH /jobs/{id}``, one request at a time, 20 a second), and
``chimes shards move 512-1023 --to URL`` runs as a process of its own, moving half the partitions,
with their jobs, triggers and run history, to the second server.

Reported: the move's wall time (the mover process, start to exit) and its phases from the catalog's
``shard_moves`` row (copying: ``started_at`` to ``fenced_at``; fenced, the drain, the last copy and
the cut-over: to ``cut_over_at``; cleaning, the target opened and the source's copies deleted: to
``finished_at``), each line the mover printed and when, the rows copied and the copy rate; the
every-second jobs' fire delay (when the target received the call, less the slot it was for) and the
longest gap between two calls of a job, before the move and from its start on; every slot from
``--duration`` seconds before the move to as long after its end counted, missing or called twice;
and each ``PATCH``'s latency before, during and after the move (the longest during it: how long the
range's writes waited out the fence).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import asyncpg
import httpx

from bench import seed
from bench.api_client import ApiProcess, team_token, wait_until
from bench.chimes_runs import Fleet, FleetShape
from bench.env import Env
from bench.procs import REPO_ROOT
from bench.report import Result, percentiles
from bench.shards import Server, servers
from bench.target import TargetProcess
from chimes.jobs import JobSpec
from chimes.services.jobs import first_fire
from chimes.store import db
from chimes.store.bulk import copy_rows, job_rows
from chimes.store.migrate import migrate

Say = Callable[[str], None]

MOVED = (512, 1023)  # the range that moves; 0-511 stay in the catalog
MOVING_JOBS = 4  # every-second jobs in the range that moves
STAYING_JOBS = 2  # and outside it, for comparison
WARM_SLOTS = 3  # each every-second job called this many times before the slots are counted
WARM_UP_PATCHES = 5  # not counted: the API's first requests open its pool
AROUND_CUT_OVER_SEC = 5  # the slots "around the cut-over": from this long before the fence to as long after the end
PATCH_PACE_SEC = 0.05  # the client's pause between two writes
OWNER = "bench"
EVERY_SECOND = {"cron": "* * * * * *"}
JOB_RUNS = """
SELECT run_id::text AS run_id, job_id::text AS job_id, extract(epoch FROM scheduled_at)::float8 AS slot, status
FROM runs WHERE job_id = ANY($1::uuid[])
"""
IN_RANGE = "SELECT count(*) FROM jobs WHERE chimes_partition_of(job_id) BETWEEN $1 AND $2"
# The rows of the range a home holds, in the moved tables (chimes.store.moves.MOVED_TABLES)
ROWS_IN_RANGE = """
SELECT (SELECT count(*) FROM jobs WHERE chimes_partition_of(job_id) BETWEEN $1 AND $2)
     + (SELECT count(*) FROM triggers WHERE partition_id BETWEEN $1 AND $2)
     + (SELECT count(*) FROM runs WHERE partition_id BETWEEN $1 AND $2)
"""
LAST_MOVE = "SELECT * FROM shard_moves ORDER BY move_id DESC LIMIT 1"


# --- the jobs ---------------------------------------------------------------------------------------

async def _fresh_database(server: Server, name: str) -> str:
    admin = await asyncpg.connect(server.dsn("postgres"))
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return server.dsn(name)


async def _place(pool: asyncpg.Pool, specs: Sequence[JobSpec], first: int, last: int) -> list[str]:
    """Each spec as a job whose partition lies in ``first``-``last`` (ids drawn until one does), with
    its first trigger, in one transaction; their ids."""
    now = datetime.now(UTC)
    placed = []
    async with pool.acquire() as conn, conn.transaction():
        for spec in specs:
            rows = job_rows([spec], OWNER, now, first_fire)
            while not first <= rows.partitions[0] <= last:
                rows = job_rows([spec], OWNER, now, first_fire)
            await copy_rows(conn, rows)
            placed.append(str(rows.jobs[0][0]))
    return placed


@dataclass
class EverySecondJobs:
    """The every-second jobs, by the path each one calls (``/every-N``)."""

    moving: dict[str, str]  # path -> job id
    staying: dict[str, str]

    @property
    def by_path(self) -> dict[str, str]:
        return self.moving | self.staying


async def _add_every_second_jobs(pool: asyncpg.Pool, target_url: str) -> EverySecondJobs:
    def spec(n: int) -> JobSpec:
        return seed.http_job(f"every-{n}", EVERY_SECOND, f"{target_url}/every-{n}", concurrency="allow")

    moving = await _place(pool, [spec(n) for n in range(MOVING_JOBS)], *MOVED)
    staying = await _place(pool, [spec(n) for n in range(MOVING_JOBS, MOVING_JOBS + STAYING_JOBS)], 0, MOVED[0] - 1)
    return EverySecondJobs({f"/every-{n}": job for n, job in enumerate(moving)},
                           {f"/every-{MOVING_JOBS + n}": job for n, job in enumerate(staying)})


# --- the API client ---------------------------------------------------------------------------------

@dataclass
class Patch:
    started: float  # wall clock
    seconds: float
    status: int | None  # None: no answer (a transport error)


@dataclass
class Patcher:
    """Renames one job through the API, one request at a time, until stopped; every answer recorded."""

    client: httpx.AsyncClient
    job_id: str
    patches: list[Patch] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            started, clock = time.time(), time.perf_counter()
            try:
                answer = await self.client.patch(f"/jobs/{self.job_id}", json={"name": f"patched-{n}"})
                status: int | None = answer.status_code
            except httpx.HTTPError:
                status = None
            self.patches.append(Patch(started, time.perf_counter() - clock, status))
            await asyncio.sleep(PATCH_PACE_SEC)  # a client's pace between writes, not a wait for a condition

    def stop(self) -> None:
        self._stop.set()

    def between(self, start: float, end: float) -> list[Patch]:
        return [p for p in self.patches if start <= p.started < end]


# --- the mover --------------------------------------------------------------------------------------

@dataclass
class MoverRun:
    started: float  # wall clock
    ended: float
    exit_code: int
    lines: list[tuple[float, str]]  # seconds after the start, the line


async def _run_mover(catalog_dsn: str, target_dsn: str, env: Env, say: Say) -> MoverRun:
    """``chimes shards move FIRST-LAST --to TARGET`` as a process of its own; each line it prints, with when."""
    started = time.time()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "chimes", "shards", "move", f"{MOVED[0]}-{MOVED[1]}", "--to", target_dsn,
        cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "CHIMES_DATABASE_URL": catalog_dsn, "CHIMES_DATA_DIR": str(env.workdir / "chimes")})
    assert process.stdout is not None
    lines: list[tuple[float, str]] = []
    with (env.workdir / "mover.log").open("w") as log:
        async for raw in process.stdout:
            line = raw.decode(errors="replace").rstrip()
            lines.append((round(time.time() - started, 3), line))
            log.write(line + "\n")
            if not line.startswith("{"):  # the log records of the target's migration: in the JSON
                say(f"move: +{lines[-1][0]:.1f}s {line}")
    code = await process.wait()
    return MoverRun(started, time.time(), code, lines)


# --- the slots ----------------------------------------------------------------------------------------

@dataclass
class Call:
    path: str
    slot: float  # epoch seconds
    received: float


def _calls(deliveries: Sequence[tuple[float, str, str]], slot_of: dict[str, float],
           paths: set[str]) -> tuple[list[Call], int]:
    """The every-second jobs' calls, each with its slot; and how many calls had no run to match."""
    calls, unmatched = [], 0
    for received, run_id, path in deliveries:
        if path not in paths:
            continue
        if run_id in slot_of:
            calls.append(Call(path, slot_of[run_id], received))
        else:
            unmatched += 1
    return calls, unmatched


def slot_accounts(calls: Sequence[Call], paths: Sequence[str], first_slot: int, last_slot: int) -> dict[str, Any]:
    """Every slot of each job from ``first_slot`` to ``last_slot`` (epoch seconds, both included): how
    many there were, how many no call was received for, and how many were called more than once."""
    expected = last_slot - first_slot + 1
    missing, twice, first_missing = 0, 0, {}
    for path in paths:
        seen: dict[int, int] = {}
        for call in calls:
            if call.path == path and first_slot <= call.slot <= last_slot:
                seen[round(call.slot)] = seen.get(round(call.slot), 0) + 1
        gaps = [s for s in range(first_slot, last_slot + 1) if s not in seen]
        missing += len(gaps)
        twice += sum(1 for n in seen.values() if n > 1)
        if gaps:
            first_missing[path] = datetime.fromtimestamp(gaps[0], UTC).isoformat()
    return {"slots": expected * len(paths), "missing": missing, "called_twice": twice,
            "first_missing_by_job": first_missing}


def delays(calls: Sequence[Call], paths: set[str], start: float, end: float) -> dict[str, Any]:
    """For the slots in [start, end): the fire delay (received - slot) percentiles, the longest, and the
    longest gap between two consecutive calls of one job, in seconds."""
    mine = sorted((c for c in calls if c.path in paths and start <= c.slot < end), key=lambda c: c.received)
    longest_gap, gap_after = 0.0, None
    last_by_path: dict[str, float] = {}
    for call in mine:
        before = last_by_path.get(call.path)
        if before is not None and call.received - before > longest_gap:
            longest_gap, gap_after = call.received - before, before
        last_by_path[call.path] = call.received
    lags = [c.received - c.slot for c in mine]
    worst = max(mine, key=lambda c: c.received - c.slot, default=None)
    return {"calls": len(mine), "fire_delay_sec": _rounded(percentiles(lags)),
            "longest_delay_slot": None if worst is None else worst.slot,
            "longest_gap_sec": round(longest_gap, 3), "longest_gap_after": gap_after}


def _rounded(summary: dict[str, float] | None, digits: int = 3) -> dict[str, float] | None:
    return None if summary is None else {k: round(v, digits) for k, v in summary.items()}


def _latencies(patches: Sequence[Patch]) -> dict[str, Any]:
    statuses: dict[str, int] = {}
    for p in patches:
        statuses[str(p.status)] = statuses.get(str(p.status), 0) + 1
    worst = max(patches, key=lambda p: p.seconds, default=None)
    return {"requests": len(patches), "latency_ms": _rounded(percentiles([p.seconds * 1000 for p in patches]), 1),
            "longest_started_at": None if worst is None else worst.started, "statuses": statuses}


# --- the scenario -----------------------------------------------------------------------------------

async def _wait(condition: Callable[[], Any], limit_sec: float, what: str, fleet: Fleet,
                api: ApiProcess | None = None) -> None:
    """``wait_until``, failing at once when a process of the fleet (or the API) has exited."""
    async def checked() -> Any:
        for proc in [*fleet.procs, *([api.proc] if api else [])]:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited:\n{proc.log_tail()}")
        done = condition()
        return await done if asyncio.iscoroutine(done) else done

    await wait_until(checked, limit_sec=limit_sec, what=what, interval=0.25)


async def _slots_by_run(dsns: Sequence[str], job_ids: Sequence[str]) -> tuple[dict[str, float], dict[str, int]]:
    """Every run of ``job_ids`` on every home: its slot by run id, and how many runs there are by status."""
    slot_of: dict[str, float] = {}
    statuses: dict[str, int] = {}
    for dsn in dsns:
        conn = await asyncpg.connect(dsn)
        try:
            for row in await conn.fetch(JOB_RUNS, list(job_ids)):
                slot_of[row["run_id"]] = row["slot"]
                statuses[row["status"]] = statuses.get(row["status"], 0) + 1
        finally:
            await conn.close()
    return slot_of, statuses


async def _count(dsn: str, query: str, *args: object) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval(query, *args))
    finally:
        await conn.close()


async def move(env: Env, target: TargetProcess, *, schedules: int, window_sec: float, say: Say) -> list[Result]:
    """The move of 512-1023 over ``schedules`` schedules; the every-second jobs' slots are counted, and
    the writes timed, from ``window_sec`` before the move to ``window_sec`` after it."""
    with servers(env.workdir, 2, say) as (catalog_server, target_server):
        name = env.database("move")
        catalog_dsn = await _fresh_database(catalog_server, name)
        target_dsn = await _fresh_database(target_server, name)
        conn = await asyncpg.connect(catalog_dsn)
        try:
            await migrate(conn)
        finally:
            await conn.close()
        pool = await db.create_pool(catalog_dsn, min_size=1, max_size=2)
        try:
            seeded_sec = await seed.add_idle_schedules(pool, schedules, say)
            jobs = await _add_every_second_jobs(pool, target.url)
            patched = (await _place(pool, [seed.http_job("patched", {"cron": "0 * * * *"}, f"{target.url}/patched")],
                                    *MOVED))[0]
        finally:
            await pool.close()
        in_range = await _count(catalog_dsn, IN_RANGE, *MOVED)
        say(f"move: {schedules:,} schedules made in {seeded_sec:.1f}s; {in_range:,} jobs in partitions "
            f"{MOVED[0]}-{MOVED[1]}")
        token = await team_token(catalog_dsn, OWNER)
        await target.reset()
        fleet = Fleet(env, catalog_dsn, FleetShape(concurrency=50), "move")
        api: ApiProcess | None = None
        try:
            await fleet.wait_ready()
            api = ApiProcess(catalog_dsn, env.workdir)
            async with httpx.AsyncClient(base_url=api.url, timeout=60,
                                         headers={"Authorization": f"Bearer {token}"}) as client:
                await api.ready(client)
                return [await _measure(env, target, fleet, api, client, catalog_dsn, target_dsn, jobs, patched,
                                       schedules=schedules, in_range=in_range, window_sec=window_sec, say=say)]
        finally:
            if api is not None:
                api.stop()
            fleet.stop()


async def _measure(env: Env, target: TargetProcess, fleet: Fleet, api: ApiProcess, client: httpx.AsyncClient,
                   catalog_dsn: str, target_dsn: str, jobs: EverySecondJobs, patched: str, *, schedules: int,
                   in_range: int, window_sec: float, say: Say) -> Result:
    paths = set(jobs.by_path)

    async def called(least: int) -> bool:
        found = [p for _, _, p in await target.deliveries()]
        return all(found.count(p) >= least for p in paths)

    for n in range(WARM_UP_PATCHES):
        (await client.patch(f"/jobs/{patched}", json={"name": f"warm-up-{n}"})).raise_for_status()
    patcher = Patcher(client, patched)
    patching = asyncio.create_task(patcher.run())
    try:
        await _wait(lambda: called(WARM_SLOTS), 60, "every every-second job to be called", fleet, api)
        first_slot = math.floor(time.time()) + 1  # every job is called each second from here on
        say(f"move: the fleet runs; slots counted from {datetime.fromtimestamp(first_slot, UTC):%H:%M:%S}")
        await asyncio.sleep(first_slot + window_sec - time.time())  # the figures before the move: a period
        mover = await _run_mover(catalog_dsn, target_dsn, env, say)
        if mover.exit_code != 0:
            raise RuntimeError(f"chimes shards move exited {mover.exit_code}:\n"
                               + "\n".join(line for _, line in mover.lines[-20:]))
        row = await _last_move(catalog_dsn)
        if row["phase"] != "done":
            raise RuntimeError(f"the move ended {row['phase']}: {row['note']}")
        last_slot = math.floor(row["finished_at"].timestamp() + window_sec)
        job_ids = list(jobs.by_path.values())

        async def every_slot_called() -> bool:
            slot_of, _ = await _slots_by_run([catalog_dsn, target_dsn], job_ids)
            calls, _ = _calls(await target.deliveries(), slot_of, paths)
            return not slot_accounts(calls, sorted(paths), first_slot, last_slot)["missing"]

        with contextlib.suppress(TimeoutError):  # what is still missing then is counted, not hidden
            await _wait(every_slot_called, window_sec + 60, "every slot to be called", fleet, api)
    finally:
        patcher.stop()
        await patching
    slot_of, run_statuses = await _slots_by_run([catalog_dsn, target_dsn], job_ids)
    calls, unmatched = _calls(await target.deliveries(), slot_of, paths)
    moved_jobs = await _count(target_dsn, IN_RANGE, *MOVED)
    left_behind = await _count(catalog_dsn, IN_RANGE, *MOVED)
    rows_on_target = await _count(target_dsn, ROWS_IN_RANGE, *MOVED)
    return _result(row, mover, calls, unmatched, patcher, jobs, fleet, schedules=schedules, in_range=in_range,
                   moved_jobs=moved_jobs, left_behind=left_behind, rows_on_target=rows_on_target,
                   first_slot=first_slot, last_slot=last_slot, run_statuses=run_statuses, window_sec=window_sec,
                   say=say)


async def _last_move(catalog_dsn: str) -> asyncpg.Record:
    conn = await asyncpg.connect(catalog_dsn)
    try:
        row = await conn.fetchrow(LAST_MOVE)
    finally:
        await conn.close()
    if row is None:
        raise RuntimeError("the mover exited and the catalog has no move")
    return row


def _result(row: asyncpg.Record, mover: MoverRun, calls: list[Call], unmatched: int, patcher: Patcher,
            jobs: EverySecondJobs, fleet: Fleet, *, schedules: int, in_range: int, moved_jobs: int,
            left_behind: int, rows_on_target: int, first_slot: int, last_slot: int, run_statuses: dict[str, int],
            window_sec: float, say: Say) -> Result:
    started, fenced, cut_over, finished = (row[k].timestamp() for k in
                                           ("started_at", "fenced_at", "cut_over_at", "finished_at"))
    phases = {"copying": round(fenced - started, 3), "fenced": round(cut_over - fenced, 3),
              "cleaning": round(finished - cut_over, 3)}
    to_cut_over = cut_over - started
    accounts = slot_accounts(calls, sorted(jobs.by_path), first_slot, last_slot)
    moving, staying = set(jobs.moving), set(jobs.staying)
    before = {"moving_jobs": delays(calls, moving, first_slot, mover.started),
              "staying_jobs": delays(calls, staying, first_slot, mover.started)}
    # from the mover's start to window_sec after the move's end: the range's first slots on the target too
    during = {"moving_jobs": delays(calls, moving, mover.started, last_slot + 1),
              "staying_jobs": delays(calls, staying, mover.started, last_slot + 1)}
    # the range neither fires nor takes writes from the fence until the target's nodes take it
    around = {"moving_jobs": delays(calls, moving, fenced - AROUND_CUT_OVER_SEC, finished + AROUND_CUT_OVER_SEC),
              "staying_jobs": delays(calls, staying, fenced - AROUND_CUT_OVER_SEC, finished + AROUND_CUT_OVER_SEC)}
    writes_during = patcher.between(mover.started, mover.ended)
    api = {"before_the_move": _latencies(patcher.between(0, mover.started)),
           "during_the_move": _latencies(writes_during),
           "after_the_move": _latencies(patcher.between(mover.ended, math.inf))}
    # instants as seconds after the fence, where the pauses fall
    for figures in (*before.values(), *during.values(), *around.values()):
        for key in ("longest_delay_slot", "longest_gap_after"):
            if figures[key] is not None:
                figures[key] = round(figures[key] - fenced, 3)
    for figures in api.values():
        if figures["longest_started_at"] is not None:
            figures["longest_started_at"] = round(figures["longest_started_at"] - fenced, 3)
    worst_delay = around["moving_jobs"]["fire_delay_sec"]
    extra: dict[str, Any] = {
        "schedules": schedules, "partitions": f"{MOVED[0]}-{MOVED[1]}", "jobs_in_range": in_range,
        "window_sec": window_sec,
        "jobs_on_target_after": moved_jobs, "jobs_in_range_left_on_source": left_behind,
        "move_wall_sec": round(mover.ended - mover.started, 3),
        "phases_sec": phases, "started_to_cut_over_sec": round(to_cut_over, 3),
        "shard_moves": {k: row[k].isoformat() if isinstance(row[k], datetime) else row[k]
                        for k in ("move_id", "phase", "passes", "rows_copied", "rows_per_sec", "note", "started_at",
                                  "fenced_at", "cut_over_at", "finished_at", "cut_over_version")},
        "rows_copied": row["rows_copied"], "passes": row["passes"],
        "jobs_triggers_runs_of_the_range_on_target": rows_on_target,
        "copy_rate_rows_per_sec": round(row["rows_copied"] / to_cut_over) if to_cut_over > 0 else None,
        "mover_lines": [{"at_sec": at, "line": line} for at, line in mover.lines],
        "every_second_jobs": {"moving": MOVING_JOBS, "staying": STAYING_JOBS,
                              "slots_from": datetime.fromtimestamp(first_slot, UTC).isoformat(),
                              "slots_to": datetime.fromtimestamp(last_slot, UTC).isoformat(),
                              **accounts, "calls_without_a_run": unmatched, "runs_by_status": run_statuses},
        "fire_delay_before_the_move": before, "fire_delay_from_the_move_on": during,
        "fire_delay_around_the_cut_over": around, "around_the_cut_over_sec": AROUND_CUT_OVER_SEC,
        # the moving jobs' around the cut-over
        "longest_fire_delay_sec": None if worst_delay is None else worst_delay["max"],
        "longest_gap_sec": around["moving_jobs"]["longest_gap_sec"],
        "api_patch": api,
        "api_pause_ms": None if api["during_the_move"]["latency_ms"] is None
        else api["during_the_move"]["latency_ms"]["max"],
        "warnings": fleet.warnings(),
    }
    say(f"move: {extra['move_wall_sec']:.1f}s, {row['rows_copied']:,} rows copied; slots missing "
        f"{accounts['missing']} of {accounts['slots']:,}")
    all_lags = [c.received - c.slot for c in calls if first_slot <= c.slot <= last_slot]
    slots_called = accounts["slots"] - accounts["missing"]
    return Result(f"move {MOVED[0]}-{MOVED[1]}, {schedules:,} schedules", "move", accounts["slots"], slots_called,
                  None, start_lag=_rounded(percentiles(all_lags)), peak_mb=fleet.peaks(), extra=extra)


# --- the report -------------------------------------------------------------------------------------

def _lag(figures: dict[str, Any]) -> str:
    lag = figures["fire_delay_sec"]
    return "-" if lag is None else f"{lag['p50']:.2f} / {lag['p99']:.2f} / {lag['max']:.2f}"


def _ms(figures: dict[str, Any]) -> str:
    lat = figures["latency_ms"]
    return "-" if lat is None else f"{lat['p50']:.1f} / {lat['p99']:.1f} / {lat['max']:.1f}"


def move_table(results: Sequence[Result]) -> str:
    lines = []
    for r in results:
        x = r.extra
        phases = x["phases_sec"]
        slots = x["every_second_jobs"]
        lines += [
            f"{r.system}: {x['jobs_in_range']:,} jobs moved to the second server "
            f"({x['jobs_on_target_after']:,} there after, {x['jobs_in_range_left_on_source']} left on the source)",
            f"  move: {x['move_wall_sec']:.1f} s (the mover process); copying {phases['copying']:.1f} s, fenced "
            f"(drain, last copy, cut-over) {phases['fenced']:.2f} s, cleaning {phases['cleaning']:.1f} s",
            f"  copied: {x['rows_copied']:,} rows in {x['passes']} passes, "
            f"{x['copy_rate_rows_per_sec'] or 0:,} rows/s (start to cut-over); the range's jobs, triggers and runs on "
            f"the target: {x['jobs_triggers_runs_of_the_range_on_target']:,}",
            "  every-second jobs, fire delay p50 / p99 / max s (slot to call received), longest gap between calls:",
        ]
        for when, key in (("before the move", "fire_delay_before_the_move"),
                          (f"from the move's start to {x['window_sec']:g} s after its end",
                           "fire_delay_from_the_move_on"),
                          (f"around the cut-over ({x['around_the_cut_over_sec']} s before the fence to as long after "
                           "the end)", "fire_delay_around_the_cut_over")):
            for side in ("moving_jobs", "staying_jobs"):
                figures = x[key][side]
                lines.append(f"    {when}, {side.replace('_', ' ')}: {_lag(figures)}; gap "
                             f"{figures['longest_gap_sec']:.2f} s ({figures['calls']} calls)")
        lines.append(f"  slots: {slots['slots']:,} from {slots['slots_from']} to {slots['slots_to']}, "
                     f"missing {slots['missing']}, called twice {slots['called_twice']}")
        if slots["missing"]:
            lines.append(f"  WARNING: {slots['missing']} slots were never called: {slots['first_missing_by_job']}")
        lines.append("  PATCH /jobs/{id} of a moving job, p50 / p99 / max ms: " + "; ".join(
            f"{when.replace('_', ' ')} {_ms(figures)} ({figures['requests']}, statuses {figures['statuses']})"
            for when, figures in x["api_patch"].items()))
        # its own lines, not the log records of the target's migration (in the JSON)
        lines += [f"  mover +{m['at_sec']:.1f}s: {m['line']}" for m in x["mover_lines"]
                  if not m["line"].startswith("{")]
    return "\n".join(lines)
