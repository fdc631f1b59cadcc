"""What one claim costs the database, executed as a worker executes it.

``python -m bench claim-plan --runs N --caps K``: N one-off runs queued by a real scheduler node (no
worker runs them), K tag caps that none of their jobs fall under, then ``claim_runs`` prepared once on
one connection and executed in the worker's claim settings (``begin_by_key``: the generic plan a
worker's connection keeps), each time for 100 runs in a transaction rolled back, so that every claim
finds the same queue. ``EXPLAIN (ANALYZE, TIMING off, BUFFERS)`` gives each execution's time and
buffer reads; the first few are left out. The statement comes from the ``chimes`` on the path: with
``PYTHONPATH`` set to another tree's ``src``, the same command measures that tree's claim.
"""

from __future__ import annotations

import re
import statistics
from typing import Any

from bench.env import Env
from bench.report import Result
from bench.skip_claim import GRACE_SEC, LEASE_SEC, queued_runs
from chimes.enums import Priority
from chimes.settings import RUN_TIMEOUT_SEC
from chimes.store.queries import sql

WARM, MEASURED = 5, 35
_TIME = re.compile(r"Execution Time: ([\d.]+) ms")
_BUFFERS = re.compile(r"Buffers: shared hit=(\d+)")


async def claim_plan(env: Env, *, runs: int, caps: int, say: Any) -> Result:
    async with queued_runs(env, env.database("claim_plan"), runs) as pool, pool.acquire() as conn:
        await conn.execute("INSERT INTO concurrency_caps (scope, name, owner, max_running) "
                           "SELECT 'tag', 'unused-' || i, '', 5 FROM generate_series(1, $1::int) i", caps)
        await conn.execute(f"PREPARE claim AS {sql('claim_runs')}")
        explain = ("EXPLAIN (ANALYZE, TIMING off, BUFFERS) EXECUTE claim(100, 'bench-claim-plan', "
                   f"{LEASE_SEC}, {GRACE_SEC}, {Priority.HIGH.value}, {Priority.BATCH.value}, {RUN_TIMEOUT_SEC}, "
                   "'{}')")
        times_ms: list[float] = []
        buffers: list[int] = []
        for n in range(WARM + MEASURED):
            await conn.execute(sql("begin_by_key"))
            plan = "\n".join(row[0] for row in await conn.fetch(explain))
            await conn.execute("ROLLBACK")
            if n >= WARM:
                times_ms.append(float(_match(_TIME, plan)))
                buffers.append(int(_match(_BUFFERS, plan)))  # the first: the whole statement's
    median_ms, reads = statistics.median(times_ms), statistics.median(buffers)
    say(f"claim-plan: {runs:,} queued runs, {caps} caps; a claim of 100 executed in {median_ms:.3f} ms by the "
        f"median of {MEASURED} ({min(times_ms):.3f}-{max(times_ms):.3f}), {reads:,.0f} buffer reads")
    return Result("chimes", "claim-plan", runs, 0, None,
                  extra={"caps": caps, "execution_ms": times_ms, "buffer_reads": buffers})


def _match(pattern: re.Pattern[str], plan: str) -> str:
    found = pattern.search(plan)
    if found is None:
        raise RuntimeError(f"EXPLAIN gave no {pattern.pattern!r}:\n{plan}")
    return found.group(1)


def plan_table(results: list[Result]) -> str:
    lines = ["queued runs | caps | claim of 100, ms: median (min-max) | buffer reads",
             "------------+------+------------------------------------+-------------"]
    for r in results:
        ms = r.extra["execution_ms"]
        spread = f"{statistics.median(ms):.3f} ({min(ms):.3f}-{max(ms):.3f})"
        lines.append(f"{r.runs:>11,} | {r.extra['caps']:>4} | {spread:<34} | "
                     f"{statistics.median(r.extra['buffer_reads']):,.0f}")
    return "\n".join(lines)
