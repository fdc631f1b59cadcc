"""A restore drill: `chimes up --backup-dir`, a base backup, jobs before and after a moment T, the
database restored to T, and Chimes started again on it: exactly the jobs of T are there, and they fire.

Prints the recovery time (the restore command, then Chimes up to the first delivered run), quoted in
docs/operations.md: `pytest tests/e2e/test_backup_restore.py -s`.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import httpx
import pytest

from chimes.store.embedded import EmbeddedPostgres
from tests.e2e.processes import Processes
from tests.helpers import free_port, wait_for
from tests.target import Target

pytestmark = pytest.mark.long  # a backup, writes and a restore to a point in time

TOKEN = re.compile(r"^\s+(chm_\S+)\s*$", re.MULTILINE)
EVERY_SECOND = "* * * * * *"
REAPED = re.compile(r"reaped run (\S+) \(re-enqueued\)")


@pytest.fixture
def folder(processes: Processes) -> Iterator[Path]:
    """Outside pytest's tmp_path: another pytest session on the machine may clean that up under a
    running server (see chimes.store.embedded.server_for_a_while). Removed after the processes stop."""
    made = Path(tempfile.mkdtemp(prefix="chimes-test-backup-"))
    yield made
    processes.stop_all()  # this teardown runs before the processes fixture's own
    shutil.rmtree(made, ignore_errors=True)


@pytest.mark.single_database("`chimes up` on the embedded server of its own data dir: no shard map")
async def test_restore_to_a_point_in_time_brings_back_exactly_the_jobs_of_then(
    processes: Processes, folder: Path, target: Target
) -> None:
    data_dir, backup_dir = folder / "data", folder / "backups"
    processes.env = {k: v for k, v in processes.env.items() if k != "CHIMES_DATABASE_URL"}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    up = processes.start("up", "up", "--data-dir", str(data_dir), "--port", str(port),
                         "--backup-dir", str(backup_dir))
    token = (await wait_for(lambda: TOKEN.search(up.output()), timeout=90, what="the admin token")).group(1)
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {token}"}) as http:
        await wait_for(lambda: _healthy(http), timeout=60, what="the API")
        await _create(http, target, ["before-backup-1", "before-backup-2"])
        backup = await _chimes(processes, "backup", "--data-dir", str(data_dir), "--backup-dir", str(backup_dir))
        assert backup.returncode == 0, backup.output
        assert "secret.key" not in _files_under(backup_dir), "the secret key went into the backup"
        # The first run of this one is in flight at T: its call is answered 4 s later.
        target.delays["/in-flight"] = lambda number: 4.0 if number == 1 else 0.0
        await _create(http, target, ["after-backup-1", "after-backup-2", "in-flight"])
        await wait_for(lambda: target.in_flight.get("/in-flight") == 1, timeout=30, what="a run in flight")
        restore_point = datetime.now(UTC)
        in_flight_run = target.calls_to("/in-flight")[0].run_id
        await wait_for(lambda: datetime.now(UTC) > restore_point, timeout=5, what="the clock to pass T")
        await _create(http, target, ["after-t-1", "after-t-2"])
        # A slot after T delivered before the stop, for the restore to fire again.
        await wait_for(lambda: any(call.received_at > restore_point.timestamp() and call.path != "/in-flight"
                                   and call.path.lstrip("/") in BEFORE_T for call in target.calls),
                       timeout=30, what="a slot after T to be delivered")

        in_use = await _chimes(processes, "restore", "--from", str(backup_dir), "--data-dir", str(data_dir),
                               "--force")
        assert in_use.returncode != 0 and "is running" in in_use.output, in_use.output

    up.signal(signal.SIGTERM)
    assert await up.exited(timeout=60) == 0, up.output()[-4000:]
    assert sorted((backup_dir / "wal").glob("0*")), "no WAL segment was archived"

    not_empty = await _chimes(processes, "restore", "--from", str(backup_dir), "--data-dir", str(data_dir),
                              "--to-time", restore_point.isoformat())
    assert not_empty.returncode != 0 and "is not empty" in not_empty.output, not_empty.output
    assert (data_dir / "postgres" / "PG_VERSION").exists(), "a refused restore touched the data dir"

    began = time.monotonic()
    restored = await _chimes(processes, "restore", "--from", str(backup_dir), "--data-dir", str(data_dir),
                             "--to-time", restore_point.isoformat(), "--force")
    restore_sec = time.monotonic() - began
    assert restored.returncode == 0, restored.output
    assert "recovery stopping before commit" in restored.output, restored.output
    beside = _entries(folder)
    assert any(name.startswith("data.replaced-") for name in beside), "the data dir that was there was not kept"
    assert not any(name.startswith(".data.restoring-") for name in beside), "the restore left its work folder"

    mark = {path: len(target.calls_to(path)) for path in _paths(ALL)}
    delivered_before = {call.run_id for call in target.calls}
    calls_before = len(target.calls)
    began = time.monotonic()
    again = processes.start("up-restored", "up", "--data-dir", str(data_dir), "--port", str(port))
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {token}"}) as http:
        await wait_for(lambda: _healthy(http), timeout=60, what="the API on the restored database")
        up_sec = time.monotonic() - began
        names = sorted(job["name"] for job in (await http.get("/jobs", params={"limit": 100})).json()["jobs"])
        assert names == sorted(BEFORE_T), names
        await wait_for(lambda: any(_new_calls(target, name, mark) for name in BEFORE_T), timeout=90,
                       what="a job of T to fire on the restored database")
        first_sec = time.monotonic() - began
        await wait_for(lambda: all(_new_calls(target, name, mark) for name in BEFORE_T), timeout=90,
                       what="every job of T to fire on the restored database")
        all_sec = time.monotonic() - began
        # The run in flight at T is retried once its lease lapses (30 s) and the reaper's round comes.
        await wait_for(lambda: len([c for c in target.calls_to("/in-flight") if c.run_id == in_flight_run]) > 1,
                       timeout=90, what="the run in flight at T to be retried")
    for name in AFTER_T:
        assert not _new_calls(target, name, mark), f"{name}, made after T, fired"
    # The run in flight at T: its lease lapsed and the reaper retried it as the same run (the same
    # Idempotency-Key for the target), the attempt raised.
    retried = [call for call in target.calls_to("/in-flight") if call.run_id == in_flight_run]
    assert [call.attempt for call in retried] == [1, 2], retried
    reaped = REAPED.findall(again.output())
    assert in_flight_run in reaped, again.output()[-4000:]
    # Slots after T were delivered before the restore and are fired again after it (late, one per slot:
    # the gap is shorter than --missed-after): as the same runs, with the same Idempotency-Key.
    repeated = [call for call in target.calls[calls_before:]
                if call.run_id in delivered_before and call.run_id != in_flight_run]
    assert repeated, "no slot after T was delivered again"
    assert all(call.headers["Idempotency-Key"] == call.run_id for call in repeated)
    print(f"\nrestore drill: chimes restore {restore_sec:.1f} s; chimes up on the restored data dir healthy "
          f"{up_sec:.1f} s after its start, the first job of T delivered {first_sec:.1f} s, every job of T "
          f"{all_sec:.1f} s ({len(reaped)} runs in flight at T reaped and retried, {len(repeated)} deliveries "
          f"of slots after T repeated with their first Idempotency-Key)\n{restored.output.strip()}")
    assert again.proc.poll() is None, again.output()[-4000:]

    # Without --to-time, the last archived commit: a clean stop archived every job.
    latest_dir = folder / "latest"
    latest = await _chimes(processes, "restore", "--from", str(backup_dir), "--data-dir", str(latest_dir))
    assert latest.returncode == 0, latest.output
    assert await asyncio.to_thread(_job_names, latest_dir) == sorted(ALL)


def _files_under(folder: Path) -> set[str]:
    return {path.name for path in folder.rglob("*")}


def _entries(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def _job_names(data_dir: Path) -> list[str]:
    server = EmbeddedPostgres(data_dir)
    dsn = server.acquire()
    try:
        async def read() -> list[str]:
            conn = await asyncpg.connect(dsn)
            try:
                return sorted(row["name"] for row in await conn.fetch("SELECT name FROM jobs"))
            finally:
                await conn.close()

        return asyncio.run(read())
    finally:
        server.release()


BEFORE_T = ["before-backup-1", "before-backup-2", "after-backup-1", "after-backup-2", "in-flight"]
AFTER_T = ["after-t-1", "after-t-2"]
ALL = BEFORE_T + AFTER_T


def _new_calls(target: Target, name: str, mark: dict[str, int]) -> bool:
    return len(target.calls_to(f"/{name}")) > mark[f"/{name}"]


def _paths(names: list[str]) -> list[str]:
    return [f"/{name}" for name in names]


class Finished:
    def __init__(self, returncode: int, output: str) -> None:
        self.returncode = returncode
        self.output = output


async def _chimes(processes: Processes, *args: str) -> Finished:
    made = await asyncio.create_subprocess_exec(sys.executable, "-m", "chimes", *args, env=processes.env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    stdout, _ = await asyncio.wait_for(made.communicate(), timeout=180)
    assert made.returncode is not None
    return Finished(made.returncode, stdout.decode(errors="replace"))


async def _create(http: httpx.AsyncClient, target: Target, names: list[str]) -> None:
    for name in names:
        # concurrency allow: a run in flight at T does not hold its job's later slots back until its lease
        # lapses, so the slots delivered between T and the stop are always fired again after the restore.
        created = await http.post("/jobs", json={"name": name, "schedule": {"cron": EVERY_SECOND},
                                                 "concurrency": "allow",
                                                 "task": {"type": "http", "url": f"{target.url}/{name}"}})
        assert created.status_code == 201, created.text


async def _healthy(http: httpx.AsyncClient) -> bool:
    try:
        return (await http.get("/healthz")).status_code == 200
    except httpx.TransportError:
        return False
