"""`chimes jobs import`: bulk load through the CLI, all or nothing."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import asyncpg
import orjson

from tests.e2e.processes import Processes


def job_line(i: int, **overrides: object) -> bytes:
    job = {"name": f"job-{i}", "schedule": {"cron": f"{i % 60} * * * *", "timezone": "Europe/Berlin"},
           "task": {"type": "http", "url": f"http://127.0.0.1:9/{i}"}} | overrides
    return orjson.dumps(job) + b"\n"


async def run_import(processes: Processes, file: Path, owner: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "chimes", "jobs", "import", str(file), "--owner", owner, env=processes.env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_import_loads_jobs_with_their_triggers(processes: Processes, tmp_path: Path,
                                                     pool: asyncpg.Pool) -> None:
    file = tmp_path / "jobs.jsonl"
    file.write_bytes(b"".join(job_line(i) for i in range(12_000)) + b"\n")  # spans several COPY chunks
    code, output = await run_import(processes, file, "bulk-team")
    assert code == 0, output
    assert "imported 12000 jobs" in output
    assert await pool.fetchval("SELECT count(*) FROM jobs WHERE owner = 'bulk-team'") == 12_000
    assert await pool.fetchval("SELECT count(*) FROM triggers WHERE kind = 0") == 12_000
    # Each trigger sits in its job's partition and on the job's cron minute.
    wrong = await pool.fetchval("""
        SELECT count(*) FROM triggers t JOIN jobs j USING (job_id)
        WHERE extract(minute FROM t.fire_at)::int <> split_part(j.cron, ' ', 1)::int
    """)
    assert wrong == 0


async def test_a_bad_line_imports_nothing(processes: Processes, tmp_path: Path, pool: asyncpg.Pool) -> None:
    file = tmp_path / "jobs.jsonl"
    lines = [job_line(i) for i in range(7000)]
    lines[6500] = job_line(6500, schedule={"cron": "0 0 * * *", "timezone": "Atlantis/Capital"})
    file.write_bytes(b"".join(lines))
    code, output = await run_import(processes, file, "bulk-team")
    assert code == 1
    assert "line 6501: schedule.timezone: unknown time zone 'Atlantis/Capital'; nothing was imported" in output
    assert await pool.fetchval("SELECT count(*) FROM jobs") == 0
    assert await pool.fetchval("SELECT count(*) FROM triggers") == 0
