"""Processes under measurement: CPU seconds and peak memory of each, and of the PostgreSQL server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parents[1]  # so `python -m bench.x` works from anywhere


class Proc:
    """A child process whose CPU time and peak resident memory the benchmark reports."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.popen = subprocess.Popen(list(argv), stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                      env={**os.environ, **(env or {})}, start_new_session=True)
        self._cpu_at_stop: float | None = None
        self._peak_at_stop: float | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def cpu_seconds(self) -> float:
        if self._cpu_at_stop is not None:
            return self._cpu_at_stop
        try:
            times = psutil.Process(self.pid).cpu_times()
        except psutil.NoSuchProcess:
            return 0.0
        return times.user + times.system + times.children_user + times.children_system

    def peak_rss_mb(self) -> float:
        """VmHWM: the most resident memory the process ever had, as the kernel counts it."""
        if self._peak_at_stop is not None:
            return self._peak_at_stop
        try:
            lines = Path(f"/proc/{self.pid}/status").read_text().splitlines()
        except OSError:
            return 0.0
        for line in lines:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (a graceful stop), SIGKILL after ``timeout``; CPU and memory are read just before."""
        if self.alive():
            self._cpu_at_stop = self.cpu_seconds()
            self._peak_at_stop = self.peak_rss_mb()
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def postgres_cpu_seconds(postmaster_pid: int | None) -> float | None:
    """CPU time of the whole server: the postmaster, its live backends and the ones that have exited."""
    if postmaster_pid is None:
        return None
    try:
        main = psutil.Process(postmaster_pid)
        times = main.cpu_times()
        total = times.user + times.system + times.children_user + times.children_system
        for child in main.children():
            try:
                ct = child.cpu_times()
                total += ct.user + ct.system
            except psutil.NoSuchProcess:
                continue
        return total
    except psutil.NoSuchProcess:
        return None


class CpuMeter:
    """CPU seconds used by some processes and the database servers between :meth:`start` and
    :meth:`stop`. ``servers``: each server's name (``postgresql``; ``primary`` and ``standby`` in a
    cluster) and its postmaster's pid, or a function that says so when asked (a cluster's members
    change roles; the pids are read at the start)."""

    def __init__(self, procs: Sequence[Proc],
                 servers: Mapping[str, int | None] | Callable[[], Mapping[str, int | None]]) -> None:
        self.procs = list(procs)
        self.servers = servers
        self._pids: Mapping[str, int | None] = {}
        self.by_name: dict[str, float] = {}
        self._start: dict[str, float] = {}
        self._mark: dict[str, float] = {}
        self.after_mark: dict[str, float] = {}
        self.wall = 0.0
        self._t0 = 0.0

    def _read(self) -> dict[str, float]:
        values = {p.name: p.cpu_seconds() for p in self.procs}
        for name, pid in self._pids.items():
            pg = postgres_cpu_seconds(pid)
            if pg is not None:
                values[name] = pg
        return values

    def start(self) -> None:
        self._pids = dict(self.servers() if callable(self.servers) else self.servers)
        self._t0 = time.monotonic()
        self._start = self._read()

    def mark(self) -> None:
        """Read the counters now too: :attr:`after_mark` is then the CPU from here to :meth:`stop`."""
        self._mark = self._read()

    def stop(self) -> dict[str, float]:
        self.wall = time.monotonic() - self._t0
        end = self._read()
        self.by_name = {name: round(end[name] - self._start.get(name, 0.0), 3) for name in end}
        if self._mark:
            self.after_mark = {name: round(end[name] - self._mark.get(name, 0.0), 3) for name in end}
        return self.by_name
