"""`chimes jobs import`: bulk load through the CLI, all or nothing, validated in this process
(``--processes 1``) or in several."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import asyncpg
import orjson
import pytest

from chimes.calendars import CalendarSpec
from chimes.cli.security_options import keyring_from
from chimes.store.calendars import put_calendar
from tests.e2e.processes import Processes
from tests.helpers import Homes

pytestmark = pytest.mark.long  # imports through real processes, on every shard count


def job_line(i: int, **overrides: object) -> bytes:
    job = {"name": f"job-{i}", "schedule": {"cron": f"{i % 60} * * * *", "timezone": "Europe/Berlin"},
           "task": {"type": "http", "url": f"http://127.0.0.1:9/{i}"}} | overrides
    return orjson.dumps(job) + b"\n"


async def run_import(processes: Processes, file: Path, owner: str, *options: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "chimes", "jobs", "import", str(file), "--owner", owner, *options, env=processes.env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=120)
    if proc.returncode < 0:  # a crash, not an answer: no test of exit codes should see it as one
        pytest.fail(f"chimes jobs import was killed by signal {-proc.returncode}:\n{out.decode()}")
    return proc.returncode, out.decode()


@pytest.mark.parametrize("validators", ["1", "3"])
async def test_import_loads_jobs_with_their_triggers(processes: Processes, tmp_path: Path,
                                                     homes: Homes, validators: str) -> None:
    file = tmp_path / "jobs.jsonl"
    file.write_bytes(b"".join(job_line(i) for i in range(12_000)) + b"\n")  # spans several COPY chunks
    code, output = await run_import(processes, file, "bulk-team", "--processes", validators)
    assert code == 0, output
    assert "imported 12000 jobs" in output
    assert await homes.total("SELECT count(*) FROM jobs WHERE owner = 'bulk-team'") == 12_000
    assert await homes.total("SELECT count(*) FROM triggers WHERE kind = 0") == 12_000
    # Each trigger sits in its job's partition and on the job's cron minute.
    wrong = await homes.total("""
        SELECT count(*) FROM triggers t JOIN jobs j USING (job_id)
        WHERE extract(minute FROM t.fire_at)::int <> split_part(j.cron, ' ', 1)::int
    """)
    assert wrong == 0
    # Job ids follow the file's order, as jobs created one by one follow the order of creation.
    names = sorted(await homes.fetch("SELECT job_id, name FROM jobs"), key=lambda r: r["job_id"])
    assert [r["name"] for r in names] == [f"job-{i}" for i in range(12_000)]
    # One audit entry a database written to, with its share of the jobs, by the command line's user.
    audited = await homes.fetch("SELECT action, actor_owner, changes FROM audit_log")
    assert {(r["action"], r["actor_owner"]) for r in audited} == {("job.import", "operator")}
    assert sum(r["changes"]["jobs"]["after"] for r in audited) == 12_000


@pytest.mark.parametrize("validators", ["1", "3"])
async def test_a_bad_line_imports_nothing(processes: Processes, tmp_path: Path, homes: Homes,
                                          validators: str) -> None:
    file = tmp_path / "jobs.jsonl"
    lines = [job_line(i) for i in range(16_000)]
    lines[6500] = job_line(6500, schedule={"cron": "0 0 * * *", "timezone": "Atlantis/Capital"})
    lines[15_000] = b"{not json\n"  # later in the file, maybe validated first: the first one is reported
    file.write_bytes(b"".join(lines))
    code, output = await run_import(processes, file, "bulk-team", "--processes", validators)
    assert code == 1
    assert "line 6501: schedule.timezone: unknown time zone 'Atlantis/Capital'; nothing was imported" in output
    assert await homes.total("SELECT count(*) FROM jobs") == 0
    assert await homes.total("SELECT count(*) FROM triggers") == 0
    assert await homes.total("SELECT count(*) FROM audit_log") == 0


async def test_secret_values_are_sealed_with_the_key_of_the_data_dir(processes: Processes, tmp_path: Path,
                                                                     homes: Homes) -> None:
    file = tmp_path / "jobs.jsonl"
    lines = [job_line(i) for i in range(12_000)]
    lines[11_000] = job_line(11_000, task={"type": "http", "url": "http://127.0.0.1:9/s",
                                           "secretHeaders": {"X-Api-Key": "s3cret-value"}})
    file.write_bytes(b"".join(lines))
    data_dir = tmp_path / "data"
    code, output = await run_import(processes, file, "bulk-team", "--processes", "2", "--data-dir", str(data_dir))
    assert code == 0, output
    [task] = [r["task"] for r in await homes.fetch("SELECT task FROM jobs WHERE name = 'job-11000'")]
    sealed = task["secretHeaders"]["X-Api-Key"]
    assert "s3cret" not in sealed
    assert keyring_from(data_dir, None).open(sealed) == "s3cret-value"
    assert await homes.total("SELECT count(*) FROM jobs WHERE task ? 'secretHeaders'") == 1


@pytest.mark.parametrize("validators", ["1", "3"])
async def test_a_line_naming_a_calendar_the_owner_does_not_have_imports_nothing(
    processes: Processes, tmp_path: Path, homes: Homes, pool: asyncpg.Pool, validators: str
) -> None:
    """As POST /jobs refuses it: the calendars a job names must be its owner's (another team's by
    that name does not count)."""
    await put_calendar(pool, "bulk-team", "holidays", CalendarSpec())
    await put_calendar(pool, "other-team", "freeze", CalendarSpec())
    file = tmp_path / "jobs.jsonl"
    lines = [job_line(i, schedule={"cron": "0 2 * * *", "excludeCalendars": ["holidays"]}) for i in range(300)]
    lines[200] = job_line(200, schedule={"cron": "0 2 * * *", "excludeCalendars": ["holidays", "freeze"]})
    file.write_bytes(b"".join(lines))
    code, output = await run_import(processes, file, "bulk-team", "--processes", validators)
    assert code == 1, output
    assert "line 201: schedule.excludeCalendars: unknown calendar 'freeze'" in output
    assert "nothing was imported" in output
    assert await homes.total("SELECT count(*) FROM jobs") == 0
    lines[200] = lines[199]
    file.write_bytes(b"".join(lines))
    code, output = await run_import(processes, file, "bulk-team", "--processes", validators)
    assert code == 0 and "imported 300 jobs" in output, output
    assert await homes.total("SELECT count(*) FROM jobs WHERE exclude_calendars = '{holidays}'") == 300
