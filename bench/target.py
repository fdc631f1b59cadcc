"""The fast local HTTP target every system calls: answers 200 at once and notes when each call came.

Runs in its own process (``python -m bench.target PORT_FILE``) so its CPU is nobody's and it is the
same for every system. A call is identified by ``X-Chimes-Run-Id`` when present, else by its path;
``GET /_stats`` returns every arrival (its time, key and path), ``GET /_count`` their number,
``POST /_reset`` forgets them.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx
import orjson
from aiohttp import web

from bench.procs import Proc, python


async def serve(port_file: Path) -> None:
    arrivals: list[tuple[float, str, str]] = []

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        if request.path == "/_stats":
            times, keys, paths = [a[0] for a in arrivals], [a[1] for a in arrivals], [a[2] for a in arrivals]
            return web.Response(body=orjson.dumps({"times": times, "keys": keys, "paths": paths}),
                                content_type="application/json")
        if request.path == "/_count":
            return web.Response(text=str(len(arrivals)))
        if request.path == "/_reset":
            arrivals.clear()
            return web.Response(text="reset")
        arrivals.append((time.time(), request.headers.get("X-Chimes-Run-Id") or request.path, request.path))
        await request.read()
        return web.Response(text="ok")

    server = web.Server(handle, access_log=None)
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(server, "127.0.0.1", 0, backlog=4096)
    port = listener.sockets[0].getsockname()[1]
    _announce(port_file, port)
    await asyncio.Event().wait()


def _announce(port_file: Path, port: int) -> None:
    port_file.write_text(str(port))


class TargetProcess:
    """The target, started in its own process; ``url`` is its base URL."""

    def __init__(self, workdir: Path) -> None:
        port_file = workdir / "target.port"
        port_file.unlink(missing_ok=True)
        self.proc = Proc("target", python("-m", "bench.target", str(port_file)), workdir / "target.log")
        deadline = time.monotonic() + 20
        while not port_file.exists() or not port_file.read_text():
            if time.monotonic() > deadline or not self.proc.alive():
                raise RuntimeError(f"the HTTP target did not start:\n{self.proc.log_tail()}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port_file.read_text()}"

    async def reset(self) -> None:
        async with httpx.AsyncClient() as client:
            (await client.post(f"{self.url}/_reset")).raise_for_status()

    async def arrivals(self) -> tuple[list[float], list[str]]:
        data = await self._stats()
        return data["times"], data["keys"]

    async def deliveries(self) -> list[tuple[float, str, str]]:
        """Every call: when it came (wall clock), its key (the run id) and its path."""
        data = await self._stats()
        return list(zip(data["times"], data["keys"], data["paths"], strict=True))

    async def _stats(self) -> dict[str, list]:
        async with httpx.AsyncClient(timeout=60) as client:
            answer = (await client.get(f"{self.url}/_stats")).raise_for_status()
        return orjson.loads(answer.content)

    async def count(self) -> int:
        async with httpx.AsyncClient() as client:
            return int((await client.get(f"{self.url}/_count")).raise_for_status().text)

    def stop(self) -> None:
        self.proc.stop(timeout=5)


def main() -> None:
    import uvloop

    uvloop.run(serve(Path(sys.argv[1])))


if __name__ == "__main__":
    main()
