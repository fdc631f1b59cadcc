"""The HTTP task's client alone: the same calls through Chimes' executor, its libcurl pool alone and aiohttp.

``python -m bench http-calls --runs N --concurrency C``: N POSTs, C at once, to the local target,
each client in a process of its own so that its CPU time is its own: Chimes' HTTP executor
(chimes.worker.tasks.http over libcurl, chimes.worker.tasks.curl, with everything a run's call
carries: Chimes' headers, the signature, the egress check, the output tail); the libcurl pool under
it alone (``CurlPool.request`` with the same header lines, made once: what the client costs without
Chimes' work around each call); and one pooled aiohttp session sending the same headers (the client
HTTP tasks went through before libcurl). The figure is the
client process's CPU per call, what a worker spends on the call itself. With
``--distinct-urls`` each call goes to a URL of its own (``/r0``, ``/r1``, ...), as the jobs of ``up``
do, which the client has not seen before.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import time
from datetime import UTC, datetime
from typing import Any

from bench.procs import python
from bench.report import Result

CLIENTS = {"chimes": "Chimes HTTP executor (libcurl)", "pool": "its libcurl pool alone, the same headers",
           "aiohttp": "aiohttp ClientSession, the same headers"}
WARM_UP = 200  # calls before the measured ones: connections opened, caches filled


async def http_calls(target_url: str, *, runs: int, concurrency: int, say: Any,
                     distinct_urls: bool = False) -> list[Result]:
    """One measurement of each client, one after the other."""
    results = []
    for client, name in CLIENTS.items():
        proc = await asyncio.create_subprocess_exec(
            *python("-m", "bench.http_calls", client, f"{target_url}/r", str(runs), str(concurrency),
                    *(["distinct"] if distinct_urls else [])),
            stdout=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"the {client} client failed with exit status {proc.returncode}")
        figures = json.loads(out)
        say(f"{name}: {runs:,} calls in {figures['wall_sec']:.2f} s, "
            f"{1e6 * figures['cpu_sec'] / runs:.1f} CPU µs a call")
        results.append(Result(name, "http-calls", runs, figures["ok"], figures["wall_sec"],
                              cpu_sec={"client": round(figures["cpu_sec"], 3)},
                              extra={"cpu_us_per_call": round(1e6 * figures["cpu_sec"] / runs, 1)},
                              notes="runs/s: calls a second; CPU: the client process only"))
    return results


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _measure(client: str, url: str, runs: int, concurrency: int, distinct: bool) -> dict[str, Any]:
    from chimes.security.ssrf import EgressPolicy
    from chimes.worker.tasks.common import TaskContext
    from chimes.worker.tasks.http import HttpExecutor, build_headers

    scheduled = datetime.now(UTC)

    def context(i: int) -> TaskContext:
        return TaskContext(f"0193e000-0000-7000-8000-{i:012d}", "0193e000-0000-7000-8000-ffffffffffff", 1,
                           scheduled, 60.0, signing_secret="whsec_bench", owner="bench")

    def url_of(i: int) -> str:
        return f"{url}{i}" if distinct else url

    slots = asyncio.Semaphore(concurrency)
    if client == "chimes":
        executor = HttpExecutor(egress=EgressPolicy.build(allow_loopback=True))

        async def call(i: int) -> bool:
            async with slots:
                return (await executor.run({"type": "http", "method": "POST", "url": url_of(i)}, context(i))).succeeded

        close = executor.close
    elif client == "pool":
        from chimes.security.ssrf import outgoing_request
        from chimes.worker.tasks.curl import CurlPool
        from chimes.worker.tasks.http import header_lines

        pool = CurlPool(EgressPolicy.build(allow_loopback=True), max_connections=1000)
        lines = header_lines(build_headers(None, context(0)))

        async def call(i: int) -> bool:
            async with slots:
                target = outgoing_request(url_of(i))
                reply = await pool.request("POST", target.url, lines, host=target.host, timeout_sec=60.0)
                return 200 <= reply.status < 300

        async def close() -> None:
            pool.close()
    else:
        import aiohttp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1000),
                                        cookie_jar=aiohttp.DummyCookieJar())

        async def call(i: int) -> bool:
            async with slots:
                headers = dict(build_headers(None, context(i)).values())
                async with session.post(url_of(i), headers=headers, timeout=aiohttp.ClientTimeout()) as response:
                    await response.read()
                    return 200 <= response.status < 300

        close = session.close
    try:
        await asyncio.gather(*(call(i) for i in range(runs, runs + WARM_UP)))  # URLs the measured calls do not reuse
        cpu, started = _cpu(), time.perf_counter()
        done = await asyncio.gather(*(call(i) for i in range(runs)))
        cpu, wall = _cpu() - cpu, time.perf_counter() - started
    finally:
        await close()
    return {"ok": sum(done), "cpu_sec": cpu, "wall_sec": wall}


if __name__ == "__main__":
    import uvloop

    which, address, count, at_once = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(uvloop.run(_measure(which, address, count, at_once, sys.argv[5:] == ["distinct"]))))
