"""A Patroni cluster for the high-availability benchmarks: two PostgreSQL members (a primary and one
standby) and three etcd members on this machine (chimes.ha.cluster), with the standby synchronous
(the supported setup) or asynchronous (to measure what that saves and what it loses)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from urllib.parse import quote

from chimes.ha.cluster import HaCluster, PatroniMember

Say = Callable[[str], None]


def mode_name(synchronous: bool) -> str:
    return "synchronous standby" if synchronous else "asynchronous standby"


@contextlib.asynccontextmanager
async def ha_cluster(workdir: Path, *, synchronous: bool, say: Say) -> AsyncIterator[HaCluster]:
    """A fresh cluster under ``workdir``, stopped after. Patroni is installed once per work folder
    and shared by the clusters made in it. Started and stopped in a thread: the event loop goes on."""
    tag = "sync" if synchronous else "async"
    cluster = HaCluster(workdir / f"ha-{tag}", postgres=2, synchronous_mode=synchronous)
    cluster.patroni_site = workdir / "patroni-site"
    say(f"starting a Patroni cluster, {mode_name(synchronous)} (etcd x3, PostgreSQL x2) ...")
    try:
        await asyncio.to_thread(cluster.start)
        yield cluster
    finally:
        await asyncio.to_thread(cluster.stop)


def member_dsn(cluster: HaCluster, member: PatroniMember, database: str) -> str:
    """One member's own address: for a benchmark that must not move to another member."""
    password = quote(cluster.layout.superuser_password, safe="")
    return f"postgresql://postgres:{password}@{member.layout.host}:{member.layout.client_port}/{database}"


def roles(cluster: HaCluster) -> Callable[[], dict[str, int | None]]:
    """The postmasters' pids by role, asked of Patroni when called (for bench.procs.CpuMeter)."""

    def pids() -> dict[str, int | None]:
        primary = cluster.primary()
        found: dict[str, int | None] = {"primary": primary.postmaster_pid() if primary else None}
        for member in cluster.postgres:
            if member is not primary:
                found["standby"] = member.postmaster_pid()
        return found

    return pids
