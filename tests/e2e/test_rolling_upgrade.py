"""A rolling upgrade from release 0.1.0 to this checkout, with no pause in firing.

Release 0.1.0's code comes out of git history (commit RELEASE_0_1_0, whose ``src`` is extracted
into a folder of its own) and runs on the same interpreter with ``PYTHONPATH`` pointing at it, as
tests/fence_check.py runs a copy. A fleet of 0.1.0 (an API server, two scheduler nodes, two workers)
starts on a fresh database with a job that fires every second, one-off jobs created all along and a
run that holds its target for several seconds; then each process is replaced, one at a time, by one
of this checkout (the first applies the expand migrations). Afterwards: every one-second slot of
the roll has its run and no slot two, every acknowledged job ran, the API answered only 2xx, 429 or
503, the long run finished once under its worker's graceful stop, and no process exited on its own.
Then the refusals: 0.1.0 on a contracted schema, and this release on a schema contracted for a later
one, each with the message that names the release to run, and nothing changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import signal
import subprocess
import time
import tomllib
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import httpx
import pytest
from packaging.requirements import Requirement

from chimes import __version__
from chimes.store.migrate import Migration, migrate, migrations
from chimes.store.tokens import create_token
from tests.conftest import scratch_database
from tests.e2e.failover import REQUEST_TIMEOUT, Writer, all_acknowledged_ran_once, processes_for
from tests.e2e.processes import ChimesProcess, Processes
from tests.helpers import auth_as, free_port, wait_for
from tests.target import Target

pytestmark = [pytest.mark.e2e, pytest.mark.single_database("runs its own fleets on databases of its own"),
              pytest.mark.long]

ROOT = Path(__file__).resolve().parents[2]
RELEASE_0_1_0 = "c608051"  # docs/operations.md, "Releases"
LONG_RUN_SEC = 8.0  # how long the target holds the long run's request
OLD_REFUSAL = ("this database's schema needs chimes 0.2.0 or later (a contract migration was applied): "
               "run chimes 0.2.0 or later")


@pytest.fixture(scope="module")
def release_0_1_0(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Release 0.1.0's ``src`` folder, from git history (CI runs on a clone with full history)."""
    folder = tmp_path_factory.mktemp("chimes-0.1.0")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", RELEASE_0_1_0, "src"], capture_output=True,
                             check=True, timeout=60)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True, timeout=60)
    src = folder / "src"
    assert '__version__ = "0.1.0"' in (src / "chimes" / "__init__.py").read_text()
    missing = _not_installed(_release_dependencies(RELEASE_0_1_0))
    assert not missing, f"release 0.1.0 needs {missing}: add them to the test extra in pyproject.toml"
    return src


def _release_dependencies(commit: str) -> list[str]:
    """The distribution names a release's pyproject.toml depends on."""
    pyproject = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:pyproject.toml"],
                               capture_output=True, text=True, check=True, timeout=60).stdout
    return [Requirement(line).name for line in tomllib.loads(pyproject)["project"]["dependencies"]]


def _not_installed(distributions: list[str]) -> list[str]:
    missing = []
    for name in distributions:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


@pytest.fixture
async def fresh_database(server_dsn: str) -> AsyncIterator[str]:
    """An empty database: the first process of the fleet migrates it."""
    async with scratch_database(server_dsn, "chimes_upgrade") as dsn:
        yield dsn


@pytest.fixture
def fleet(fresh_database: str, tmp_path: Path) -> Iterator[Processes]:
    procs = processes_for(fresh_database, tmp_path)
    yield procs
    procs.stop_all()


def on_release(release_src: Path) -> dict[str, str]:
    """The environment that makes ``python -m chimes`` run the release whose ``src`` this is."""
    return {"PYTHONPATH": str(release_src)}


class Reader:
    """Reads a job through the API every 0.2 s and records each answer's status (None: no answer)."""

    def __init__(self, client: httpx.AsyncClient, job_id: str) -> None:
        self.client, self.job_id = client, job_id
        self.statuses: list[int | None] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._keep_reading())

    async def _keep_reading(self) -> None:
        while True:
            try:
                self.statuses.append((await self.client.get(f"/jobs/{self.job_id}")).status_code)
            except httpx.HTTPError:
                self.statuses.append(None)
            await asyncio.sleep(0.2)  # a client's pace, not a wait for a condition

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def _registered(dsn: str, table: str, key: str, name: str) -> bool:
    """Whether process ``name`` heartbeats as this checkout's release."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        release = await conn.fetchval(f"SELECT release FROM {table} WHERE {key} = $1 "
                                      "AND heartbeat_at > now() - interval '10 seconds'", name)
    except asyncpg.UndefinedColumnError:  # the first process of this release has not migrated yet
        return False
    finally:
        await conn.close()
    return bool(release == __version__)


def _api(procs: Processes, name: str, env: dict[str, str] | None = None) -> tuple[ChimesProcess, str]:
    port = free_port()
    return procs.start(name, "api", "--host", "127.0.0.1", "--port", str(port), env=env), f"http://127.0.0.1:{port}"


async def _healthy(client: httpx.AsyncClient, url: str, version: str | None = None) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        answer = await client.get(f"{url}/healthz")
        return answer.status_code == 200 and (version is None or answer.json().get("version") == version)
    return False


async def _plan(procs: Processes) -> str:
    plan = procs.start(f"plan-{uuid.uuid4().hex[:4]}", "migrate", "--plan")
    assert await plan.exited(60) == 0, plan.output()
    return plan.output()


@pytest.mark.timeout(300)
async def test_a_fleet_rolls_from_0_1_0_to_this_release_without_a_pause_in_firing(
        fleet: Processes, fresh_database: str, release_0_1_0: Path, target: Target) -> None:
    dsn, old = fresh_database, on_release(release_0_1_0)
    migrate_old = fleet.start("migrate-0.1.0", "migrate", env=old)
    assert await migrate_old.exited(90) == 0, migrate_old.output()
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        # the tokens table is the same in both releases
        token = await create_token(conn, "team", admin=False)
    finally:
        await conn.close()

    api, api_url = _api(fleet, "api-0.1.0", old)
    roles = {name: fleet.start(name, *args, env=old) for name, args in {
        "node-1": ["scheduler", "--node-id", "node-1", "--lease-ttl", "3"],
        "node-2": ["scheduler", "--node-id", "node-2", "--lease-ttl", "3"],
        "worker-1": ["worker", "--worker-id", "worker-1", "--lease-sec", "3", "--shutdown-grace", "30"],
        "worker-2": ["worker", "--worker-id", "worker-2", "--lease-sec", "3", "--shutdown-grace", "30"],
    }.items()}
    target.delays["/long"] = lambda _: LONG_RUN_SEC
    async with httpx.AsyncClient(base_url=api_url, headers=auth_as(token), timeout=REQUEST_TIMEOUT + 15) as client:
        writer = Writer(client, target.url)
        reader: Reader | None = None
        try:
            await writer.api_up()
            tick = await writer.create("tick", {"cron": "* * * * * *"})
            assert tick.status_code == 201, tick.text
            tick_id = tick.json()["jobId"]
            await wait_for(lambda: len(target.calls_to("/tick")) >= 2, timeout=60, what="the first ticks")
            reader = Reader(client, tick_id)
            reader.start()
            await writer.start()
            long = await writer.create("long", {"at": (datetime.now(UTC) + timedelta(seconds=1)).isoformat()})
            assert long.status_code == 201, long.text
            long_id = long.json()["jobId"]
            await wait_for(lambda: target.calls_to("/long"), timeout=30, what="the long run to reach its target")

            # Before the roll: the plan (which changes nothing) names the expand step the first new process applies.
            first_plan = await _plan(fleet)
            expand = next(line for line in first_plan.splitlines() if "expand steps pending" in line)
            assert "0020_process_releases" in expand and "can roll: yes" in first_plan, first_plan
            roll_started = time.time()
            # The worker holding the long run goes first, while the target still holds its request.
            holder = await _worker_of(dsn, long_id)
            order = [holder, "api", "node-1", "node-2", "worker-2" if holder == "worker-1" else "worker-1"]
            mid_roll_plan = ""
            for name in order:
                if name == "api":
                    new_api, new_url = _api(fleet, "api")
                    await wait_for(lambda: _healthy(client, new_url, __version__), timeout=60,  # noqa: B023
                                   what="the new API")
                    client.base_url = httpx.URL(new_url)  # as a load balancer moves to the new server
                    assert await _stopped(api, 30) == 0, api.output()[-3000:]
                    api = new_api
                    continue
                role, table, key = ("scheduler", "scheduler_nodes", "node_id") if name.startswith("node") \
                    else ("worker", "workers", "worker_id")
                extra = ["--lease-ttl", "3"] if role == "scheduler" else [
                    "--lease-sec", "3", "--shutdown-grace", "30"]
                fresh = fleet.start(f"{name}-new", role, f"--{key.replace('_', '-')}", f"{name}-new", *extra)
                await wait_for(lambda: _registered(dsn, table, key, f"{name}-new"), timeout=60,  # noqa: B023
                               what=f"{name}'s replacement to heartbeat")
                if not mid_roll_plan:
                    mid_roll_plan = await _plan(fleet)
                if name == holder:  # SIGTERM while its run is in flight: the graceful stop lets it finish
                    assert target.in_flight.get("/long") == 1, "the long run ended before the roll reached it"
                assert await _stopped(roles[name], 45) == 0, roles[name].output()[-3000:]
                roles[name] = fresh
            roll_ended = time.time()
            print(f"roll: {roll_ended - roll_started:.1f} s", flush=True)

            # The slots of the roll, and two more, fire: every one has its run, and it ran (a slot recorded
            # as skipped, say for a run still active, has a row and no delivery).
            first, last = int(roll_started), int(roll_ended) + 2
            expected = list(range(first, last + 1))

            async def all_ran() -> bool:
                return await _ran_slots(dsn, tick_id, first, last) == expected

            with contextlib.suppress(AssertionError):  # what is missing is reported below, with its status
                await wait_for(all_ran, timeout=60, what="every tick of the roll to run")
            await writer.stop()
            await reader.stop()
            twice = await all_acknowledged_ran_once(dsn, writer.acknowledged)
            slots = await _ran_slots(dsn, tick_id, first, last)
            not_run = await _slots_not_run(dsn, tick_id, first, last)
            final_plan = await _plan(fleet)
        finally:
            await writer.stop(cancel=True)
            if reader is not None:
                await reader.stop()
    for process in [api, *roles.values()]:
        assert process.proc.poll() is None, f"{process.name} exited:\n{process.output()[-3000:]}"

    assert twice == [], "a slot made two runs"
    assert slots == expected, (f"slots that did not run: {sorted(set(expected) - set(slots))}; "
                               f"recorded without running: {not_run}")
    answers = {w.status for w in writer.writes} | set(reader.statuses if reader else [])
    print(f"writes: {len(writer.writes)}, reads: {len(reader.statuses) if reader else 0}, answers: {answers}",
          flush=True)
    assert all(s is not None and (200 <= s < 300 or s in (429, 503)) for s in answers), answers
    # The long run's worker stopped gracefully: it finished the run, once, on its first attempt.
    assert len(target.calls_to("/long")) == 1
    assert await _attempts(dsn, long_id) == [(1, "succeeded")]
    # Mid-roll the plan saw both releases; after it, every process is of this release.
    assert "(0.1.0 or earlier)" in mid_roll_plan and f"({__version__})" in mid_roll_plan, mid_roll_plan
    assert "can roll: yes" in final_plan and "or earlier" not in final_plan, final_plan
    assert "contract: nothing to contract" in final_plan, final_plan


async def _stopped(process: ChimesProcess, timeout: float) -> int:
    """SIGTERM, then its exit code, without blocking the loop (the target answers the long run in it)."""
    process.signal(signal.SIGTERM)
    return await process.exited(timeout)


async def _worker_of(dsn: str, job_id: str) -> str:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        return str(await wait_for(lambda: conn.fetchval("SELECT worker_id FROM runs WHERE job_id = $1 "
                                                         "AND status = 'running'", uuid.UUID(job_id)),
                                  timeout=30, what="the long run's worker"))
    finally:
        await conn.close()


async def _ran_slots(dsn: str, job_id: str, first: int, last: int) -> list[int]:
    """The seconds from ``first`` to ``last`` (epoch) whose run of the job ran: delivered to the target,
    which answered (succeeded). A run recorded ``skipped`` never reached it, and does not count."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        rows = await conn.fetch("SELECT extract(epoch FROM scheduled_at)::bigint AS at FROM runs "
                                "WHERE job_id = $1 AND scheduled_at BETWEEN to_timestamp($2) AND to_timestamp($3) "
                                "AND status = 'succeeded' ORDER BY 1", uuid.UUID(job_id), first, last)
    finally:
        await conn.close()
    return [r["at"] for r in rows]


async def _slots_not_run(dsn: str, job_id: str, first: int, last: int) -> list[tuple[int, str, str | None]]:
    """The job's runs from ``first`` to ``last`` that did not succeed: (second, status, error)."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        rows = await conn.fetch("SELECT extract(epoch FROM scheduled_at)::bigint AS at, status, error FROM runs "
                                "WHERE job_id = $1 AND scheduled_at BETWEEN to_timestamp($2) AND to_timestamp($3) "
                                "AND status <> 'succeeded' ORDER BY 1", uuid.UUID(job_id), first, last)
    finally:
        await conn.close()
    return [(r["at"], r["status"], r["error"]) for r in rows]


async def _attempts(dsn: str, job_id: str) -> list[tuple[int, str]]:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        rows = await conn.fetch("SELECT h.attempt, h.status FROM run_attempt_history h JOIN runs r "
                                "ON (r.run_id, r.scheduled_at) = (h.run_id, h.scheduled_at) "
                                "WHERE r.job_id = $1 ORDER BY h.attempt", uuid.UUID(job_id))
    finally:
        await conn.close()
    return [(r["attempt"], r["status"]) for r in rows]


async def _contract(dsn: str, version: int, release: str) -> None:
    """A contract step that needs ``release`` applied as a release of ``release`` would (it drops a
    table that only older releases read)."""
    step = Migration(version, f"contract_for_{release.replace('.', '_')}",
                     f"-- contract: requires every process at release >= {release}\n"
                     f"DROP TABLE IF EXISTS only_before_{version};", contract_release=release)
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        assert await migrate(conn, contract=True, steps=[*migrations(), step], release=release) == [version]
    finally:
        await conn.close()


async def _schema_facts(dsn: str) -> tuple[list[int], int, int]:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        versions = [r["version"] for r in await conn.fetch("SELECT version FROM chimes_migrations ORDER BY 1")]
        nodes = await conn.fetchval("SELECT count(*) FROM scheduler_nodes")
        workers = await conn.fetchval("SELECT count(*) FROM workers")
    finally:
        await conn.close()
    return versions, nodes, workers


@pytest.mark.timeout(180)
async def test_release_0_1_0_refuses_a_contracted_schema_naming_the_release_to_run(
        fleet: Processes, fresh_database: str, release_0_1_0: Path) -> None:
    conn = await asyncpg.connect(fresh_database, timeout=10)
    try:
        await migrate(conn)
    finally:
        await conn.close()
    await _contract(fresh_database, 9001, "0.2.0")
    before = await _schema_facts(fresh_database)
    for role in (["scheduler", "--node-id", "old-node"], ["worker", "--worker-id", "old-worker"], ["migrate"]):
        process = fleet.start(f"old-{role[0]}", *role, env=on_release(release_0_1_0))
        assert await process.exited(90) != 0
        # 0.1.0 prints the error's traceback; it ends with the exception the view raised, and its hint.
        ending = process.output().strip().splitlines()[-2:]
        print(f"0.1.0's `chimes {role[0]}` ends with:", *ending, sep="\n", flush=True)
        assert ending == [f"asyncpg.exceptions.RaiseError: {OLD_REFUSAL}", 'HINT:  docs/operations.md, "Upgrades"'], \
            process.output()[-3000:]
    assert await _schema_facts(fresh_database) == before


@pytest.mark.timeout(180)
async def test_this_release_refuses_a_schema_contracted_for_a_later_one(
        fleet: Processes, fresh_database: str) -> None:
    conn = await asyncpg.connect(fresh_database, timeout=10)
    try:
        await migrate(conn)
    finally:
        await conn.close()
    await _contract(fresh_database, 9002, "9.0.0")
    before = await _schema_facts(fresh_database)
    expected = (f"Error: this database's schema needs chimes 9.0.0 or later (contract migration "
                f"9002_contract_for_9_0_0 was applied); this is chimes {__version__}: run chimes 9.0.0 or later")
    for role in (["scheduler", "--node-id", "node"], ["worker", "--worker-id", "worker"], ["api", "--port",
                                                                                          str(free_port())]):
        process = fleet.start(role[0], *role)
        assert await process.exited(90) == 1, process.output()[-3000:]
        assert process.output().strip().splitlines()[-1] == expected, process.output()[-3000:]
    plan = await _plan(fleet)
    assert f"cannot roll: the schema needs chimes 9.0.0 or later; this is chimes {__version__}" in plan, plan
    assert await _schema_facts(fresh_database) == before
