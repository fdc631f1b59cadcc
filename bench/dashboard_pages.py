"""Times the dashboard's pages over a big database: N jobs (50 owners), run history for some of them.

    python bench/dashboard_pages.py 1000000            # embedded PostgreSQL in a temporary folder
    CHIMES_DATABASE_URL=postgresql://... python bench/dashboard_pages.py 10000000

Seeds with SQL (fast, in the database), serves the real API on 127.0.0.1, signs in as an admin and
as one team, and prints the median time of each page over a few requests.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import asyncpg
import httpx

from chimes.api.app import create_app
from chimes.cli.runtime import api_server
from chimes.store.embedded import EmbeddedPostgres
from chimes.store.migrate import migrate
from chimes.store.tokens import create_token

SEED_JOBS = """
INSERT INTO jobs (job_id, owner, name, cron, timezone, task, retry_policy, timeout_sec, concurrency, priority, paused)
SELECT gen_random_uuid(), 'team-' || (i % 50), 'job-' || i, '*/5 * * * *', 'UTC',
       jsonb_build_object('type', 'http', 'method', 'POST', 'url', 'http://127.0.0.1:9/hooks/' || (i % 1000)),
       '{"maxAttempts": 3}', 60, 'skip', 1, i % 5000 = 0
FROM generate_series($1::bigint, $2::bigint) AS i
"""
SEED_TRIGGERS = """
INSERT INTO triggers (partition_id, fire_at, trigger_id, job_id, job_version, kind)
SELECT (abs(hashtext(job_id::text)) % 1024)::smallint, now() + interval '1 hour', job_id, job_id, 1, 0
FROM jobs WHERE NOT paused
"""
# Run history for the first jobs by name: 40 runs each over the last hour, every 7th failed.
SEED_RUNS = """
INSERT INTO runs (run_id, scheduled_at, job_id, owner, partition_id, job_version, trigger, priority, status,
                  attempt, fired_at, started_at, finished_at, error)
SELECT (lpad(to_hex((extract(epoch FROM t) * 1000)::bigint), 12, '0') || '7'
        || substr(md5(j.job_id::text || k), 1, 19))::uuid,
       date_trunc('milliseconds', t), j.job_id, j.owner, 0, 1, 'schedule', 1,
       CASE WHEN k % 7 = 0 THEN 'failed' ELSE 'succeeded' END, 1, t + interval '5 ms', t + interval '20 ms',
       t + interval '300 ms', CASE WHEN k % 7 = 0 THEN 'HTTP 503' END
FROM (SELECT job_id, owner FROM jobs ORDER BY lower(name) COLLATE "C" LIMIT $1) j
CROSS JOIN generate_series(1, 40) AS k
CROSS JOIN LATERAL (SELECT date_trunc('milliseconds', now()) - k * interval '90 seconds' AS t) at
"""


async def seed(dsn: str, jobs: int) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn)
        if await conn.fetchval("SELECT count(*) FROM (SELECT 1 FROM jobs LIMIT 1) x"):
            print("database already has jobs: timing it as it is")
            return
        started = time.perf_counter()
        step = 250_000
        for first in range(0, jobs, step):
            await conn.execute(SEED_JOBS, first, min(jobs, first + step) - 1)
        await conn.execute(SEED_TRIGGERS)
        await conn.execute(SEED_RUNS, 5000)
        await conn.execute("ANALYZE")
        print(f"seeded {jobs:,} jobs and 200,000 runs in {time.perf_counter() - started:.0f} s")
    finally:
        await conn.close()


async def timed(browser: httpx.AsyncClient, path: str, repeat: int = 5) -> float:
    took = []
    for _ in range(repeat):
        started = time.perf_counter()
        response = await browser.get(path)
        took.append(time.perf_counter() - started)
        assert response.status_code == 200, (path, response.status_code)
    return statistics.median(took) * 1000


async def main(jobs: int, dsn: str) -> None:
    await seed(dsn, jobs)
    conn = await asyncpg.connect(dsn)
    admin = await create_token(conn, "admin", admin=True)
    team = await create_token(conn, "team-7")
    job_id = await conn.fetchval("SELECT job_id FROM runs WHERE owner = 'team-7' LIMIT 1")  # seen by both
    run_id = await conn.fetchval("SELECT run_id FROM runs WHERE job_id = $1 LIMIT 1", job_id)
    await conn.close()
    server = api_server(create_app(dsn, pool_size=4), "127.0.0.1", 0)
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn offers no event to wait on
        await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    pages = ["/ui/jobs", "/ui/jobs?q=job-99", "/ui/jobs?q=no-such-name", "/ui/jobs?show=paused",
             "/ui/jobs?show=failing", f"/ui/jobs/{job_id}", f"/ui/jobs/{job_id}?status=failed",
             f"/ui/runs/{run_id}", "/ui/fleet", "/metrics"]
    for who, token in (("admin", admin), ("team-7", team)):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as browser:
            await browser.post("/ui/login", data={"token": token, "next": "/ui/jobs"})
            for path in pages:
                took = await timed(browser, path)
                print(f"{who:7} {path.split('?')[0][:30]:30} {path.partition('?')[2]:22} {took:8.1f} ms")
    server.stop()
    await task


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    external = os.environ.get("CHIMES_DATABASE_URL")
    if external:
        asyncio.run(main(count, external))
    else:
        folder = Path(tempfile.mkdtemp(prefix="chimes-bench-"))
        server = EmbeddedPostgres(folder)
        try:
            asyncio.run(main(count, server.acquire()))
        finally:
            server.release()
            shutil.rmtree(folder, ignore_errors=True)
