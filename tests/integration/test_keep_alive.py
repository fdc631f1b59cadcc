"""The API keeps an idle connection open longer than its clients do.

A server that closes an idle keep-alive connection first races the client's next request on it:
the request is sent as the connection closes and fails with no answer (a `chimes chaos` run found
one such write among 7,000, after 5 s idle: uvicorn's default and httpx's alike). With the API
holding idle connections for 75 s, the client (or the load balancer in front) always closes first.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

IDLE_SEC = 6.0  # past uvicorn's default keep-alive (5 s): the idleness itself is what is tested


async def test_a_connection_idle_for_longer_than_five_seconds_still_serves_the_next_request(api_url: str) -> None:
    address = urlsplit(api_url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    request = f"GET /healthz HTTP/1.1\r\nHost: {address.netloc}\r\n\r\n".encode()
    try:
        await _get(reader, writer, request)
        await asyncio.sleep(IDLE_SEC)
        assert not reader.at_eof(), "the API closed the idle connection"
        await _get(reader, writer, request)  # served on the same connection
    finally:
        writer.close()


async def _get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> None:
    writer.write(request)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
    assert head.startswith(b"HTTP/1.1 200"), head
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    await reader.readexactly(length)
