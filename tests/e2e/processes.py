"""Real ``chimes`` processes for end-to-end tests: started through the CLI, stopped with signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import wait_for


class ChimesProcess:
    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path,
                 prefix: list[str] | None = None) -> None:
        """``prefix``: a command that runs the process, e.g. ``ip netns exec NS`` (it must exec it)."""
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "chimes", *args], env=env, stdout=self._log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL the whole process group: no chance to clean up, as in a real crash."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()
        return self.proc.returncode

    async def exited(self, timeout: float) -> int:
        """Wait for the process to exit without blocking the event loop (the test's HTTP target
        runs in it); returns the exit code."""
        try:
            await wait_for(lambda: self.proc.poll() is not None, timeout=timeout, what=f"{self.name} to exit")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; its log ends with:\n{self.output()[-4000:]}") from None
        return self.proc.returncode

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")


class Processes:
    """Starts processes against one database and makes sure none outlives the test."""

    def __init__(self, database_url: str, log_dir: Path) -> None:
        # Targets are on 127.0.0.1, which `chimes worker` and `chimes scheduler` refuse unless allowed.
        self.env = {**os.environ, "CHIMES_DATABASE_URL": database_url, "PYTHONUNBUFFERED": "1",
                    "CHIMES_LOG_LEVEL": "INFO", "CHIMES_EGRESS_ALLOW_LOOPBACK": "true"}
        self.log_dir = log_dir
        self.started: list[ChimesProcess] = []

    def start(self, name: str, *args: str, env: dict[str, str] | None = None,
              prefix: list[str] | None = None) -> ChimesProcess:
        process = ChimesProcess(name, list(args), {**self.env, **(env or {})}, self.log_dir, prefix)
        self.started.append(process)
        return process

    def scheduler(self, name: str, lease_ttl: float = 3.0) -> ChimesProcess:
        return self.start(name, "scheduler", "--node-id", name, "--lease-ttl", str(lease_ttl))

    def worker(self, name: str, lease_sec: float = 3.0, concurrency: int = 50,
               shutdown_grace: float = 30.0) -> ChimesProcess:
        return self.start(name, "worker", "--worker-id", name, "--lease-sec", str(lease_sec),
                          "--concurrency", str(concurrency), "--shutdown-grace", str(shutdown_grace))

    def stop_all(self) -> None:
        for process in self.started:
            process.stop()


@pytest.fixture
def processes(database_url: str, tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(database_url, tmp_path)
    yield procs
    procs.stop_all()
