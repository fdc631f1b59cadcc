"""Zones on one machine: network namespaces on a bridge, for the zone failure tests and
``chimes chaos --zones``.

Each zone is a namespace joined to a bridge by a veth pair; the host side of the bridge has the
first address of the subnet. Neighbour (ARP) entries are static, so a zone cut off by taking its
veth off the bridge vanishes as a lost zone does: packets to and from it are dropped, nobody gets a
reset or an "unreachable", and connections to it hang until something bounds them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


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


LIBFAKETIME_PATHS = ("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
                     "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1", "/usr/lib/faketime/libfaketime.so.1")


def skewed_clock(offset_sec: float) -> dict[str, str]:
    """The environment that gives a process a wall clock ``offset_sec`` ahead (or behind, when
    negative) of the host's, as a zone whose time servers are gone would have: libfaketime
    (Debian's ``libfaketime``) preloaded. The monotonic clock is left alone, as NTP leaves it, so
    timers and timeouts keep their length; only what the process reads as the time of day moves."""
    library = next((path for path in LIBFAKETIME_PATHS if Path(path).exists()), None)
    if library is None:
        raise ZonesUnavailable("libfaketime is not installed (apt-get install libfaketime)")
    return {"LD_PRELOAD": library, "FAKETIME": f"{offset_sec:+g}s", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


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

    def prefix(self, zone: int) -> list[str]:
        """The command prefix that runs a program inside the zone."""
        return ["ip", "netns", "exec", self.namespace(zone)]

    def zone_of(self, address: str) -> int:
        return next(zone for zone in self._names if self.address(zone) == address)

    @property
    def network(self) -> str:
        return f"10.213.{self.subnet}.0/24"

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
