"""Bounded waits on the database: keepalives on every connection's socket, one URL per host, and
errors that name themselves in logs."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

from chimes.store.db import Timeouts, describe, set_keepalive, split_hosts


async def test_keepalives_and_a_user_timeout_are_set_on_the_connection_socket() -> None:
    accepted: list[asyncio.StreamWriter] = []
    server = await asyncio.start_server(lambda _r, w: accepted.append(w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport, _ = await asyncio.get_running_loop().create_connection(asyncio.Protocol, "127.0.0.1", port)
    try:
        set_keepalive(SimpleNamespace(_transport=transport), Timeouts())  # type: ignore[arg-type]
        sock = transport.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 10_000
    finally:
        transport.close()
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()


def test_logged_errors_name_their_type_even_without_a_message() -> None:
    assert describe(TimeoutError()) == "TimeoutError"
    assert describe(OSError(113, "No route to host")) == "OSError: [Errno 113] No route to host"


def test_a_multi_host_url_is_split_into_one_url_per_host() -> None:
    url = "postgresql://u:p@h1:5432,h2:6432/chimes?target_session_attrs=read-write"
    assert split_hosts(url) == ["postgresql://u:p@h1:5432/chimes?target_session_attrs=read-write",
                                "postgresql://u:p@h2:6432/chimes?target_session_attrs=read-write"]
    assert split_hosts("postgresql://postgres@/chimes?host=/tmp") == ["postgresql://postgres@/chimes?host=/tmp"]
