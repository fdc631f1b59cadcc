"""Faults of an embedded PostgreSQL server (chimes.store.embedded): a restart, clean or a crash, and
a stall in which the server stays up and answers nothing."""

from __future__ import annotations

import contextlib
import signal

import psutil

from chimes.store.embedded import EmbeddedPostgres, pg_ctl


def restart_server(server: EmbeddedPostgres, mode: str = "fast") -> None:
    """Stop the server and start it again: ``fast`` ends sessions cleanly, ``immediate`` is a crash
    (the start replays the WAL)."""
    pg_ctl(["-w", "-t", "60", "-m", mode, "-l", str(server.pgdata / "server.log"), "restart"],
           pgdata=server.pgdata, user=server.runs_as, timeout=90)


def freeze_server(server: EmbeddedPostgres, frozen: bool = True) -> None:
    """SIGSTOP (or SIGCONT) the server and every process of it: a database that stalls without going
    away, its sessions kept open and unanswered (the ``stop_postgres_shard`` fault). The postmaster
    stops first, so it forks nobody meanwhile, and resumes last."""
    pid = server.postmaster_pid()
    if pid is None:
        raise RuntimeError(f"the embedded PostgreSQL in {server.pgdata} is not running")
    postmaster = psutil.Process(pid)
    if frozen:
        postmaster.send_signal(signal.SIGSTOP)
    for child in postmaster.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            child.send_signal(signal.SIGSTOP if frozen else signal.SIGCONT)
    if not frozen:
        postmaster.send_signal(signal.SIGCONT)
