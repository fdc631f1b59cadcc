"""The fleet under test: real ``python -m chimes`` processes on one machine and their PostgreSQL.

Each member is one role process that the fault runner can SIGKILL and start again, or SIGSTOP and
SIGCONT. The database is the harness's own embedded PostgreSQL in the work folder (so it can be
restarted too), unless a database URL is given; with ``ha``, a Patroni cluster of its own.

With ``zones`` the cluster and the fleet are spread over three zones (network namespaces on a
bridge, chimes.ha.zones): each zone holds an etcd member, a scheduler node and a worker, zones 1 and
2 a PostgreSQL server each; the API, the target and the harness sit on the host, as a fourth zone.
Zone 3's processes run on a clock ``zone_clock_skew`` seconds off the host's (libfaketime).

With ``shards`` N > 1 the harness starts N embedded PostgreSQL servers: the catalog and N-1 shards
(docs/scaling.md, "Shards"), each holding an even share of the 1,024 partitions, the catalog the
first; every role process serves every home. A shard's server can be stopped (SIGSTOP) and resumed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cryptography.fernet import Fernet

from chimes.ha.cluster import HaCluster
from chimes.ha.zones import Zones, skewed_clock
from chimes.ids import PARTITION_COUNT
from chimes.store.embedded import EmbeddedPostgres
from chimes_chaos.postgres import freeze_server, restart_server


@dataclass(frozen=True, slots=True)
class FleetShape:
    schedulers: int = 3
    workers: int = 3
    lease_ttl: float = 3.0  # chimes scheduler --lease-ttl: how soon a lost node's partitions move
    worker_lease: float = 5.0  # chimes worker --lease-sec: how soon a lost worker's runs are retried
    worker_concurrency: int = 50

    @property
    def lease_renew_sec(self) -> float:
        return min(1.0, self.lease_ttl / 4)  # as chimes.cli.roles.run_scheduler renews


@dataclass(frozen=True, slots=True)
class Exit:
    member: str
    code: int | None
    started: float  # epoch seconds the process had started
    at: float  # epoch seconds it was found gone
    log_tail: str


class Member:
    """One role process. ``down_on_purpose`` tells the supervisor not to bring it back yet."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path,
                 prefix: list[str] | None = None) -> None:
        self.name = name
        self.args = args
        self.env = env
        self.prefix = prefix or []  # e.g. `ip netns exec ZONE`, which execs the process in place
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.frozen = False
        self.down_on_purpose = False
        self.starts = 0
        self.started = 0.0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [*self.prefix, sys.executable, "-m", "chimes", *self.args], env=self.env, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        self.frozen = False
        self.down_on_purpose = False
        self.starts += 1
        self.started = time.time()

    def kill(self) -> None:
        """SIGKILL the process group: no clean-up, as in a crash or an OOM kill."""
        self.down_on_purpose = True
        if self.alive and self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.frozen = False

    def freeze(self) -> None:
        if self.alive and self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGSTOP)
            self.frozen = True

    def thaw(self) -> None:
        if self.alive and self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGCONT)
        self.frozen = False

    def terminate(self, timeout: float = 20.0) -> None:
        if not self.alive or self.proc is None:
            return
        self.thaw()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, lines: int = 5) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


ZONES = 3
SKEWED_ZONE = 3  # the zone without PostgreSQL


class Fleet:
    def __init__(self, work_dir: Path, shape: FleetShape, database_url: str | None = None, *,
                 ha: bool = False, zones: bool = False, zone_clock_skew: float = 0.0, shards: int = 1) -> None:
        if shards < 1:
            raise ValueError("a fleet needs one database at least (--shards 1)")
        if shards > 1 and (database_url or ha or zones):
            raise ValueError("--shards starts the harness's own embedded servers: it cannot be combined with "
                             "--database-url, --ha or --zones")
        self.work_dir = work_dir
        self.shape = shape
        self.zones = Zones(ZONES) if zones else None
        self.zone_clock_skew = zone_clock_skew
        # --ha: a Patroni cluster of the harness's own, whose primary the faults kill, freeze and move.
        self.cluster: HaCluster | None = None
        if self.zones is not None:
            zoned = self.zones
            hosts = [zoned.address(z) for z in range(1, ZONES + 1)]
            self.cluster = HaCluster(work_dir / "ha", postgres=2, hosts=hosts, allowed_networks=[zoned.network],
                                     prefixes={zoned.address(z): zoned.prefix(z) for z in range(1, ZONES + 1)})
        elif ha and not database_url:
            self.cluster = HaCluster(work_dir / "ha", postgres=2)
        own = database_url is None and self.cluster is None
        self.postgres = EmbeddedPostgres(work_dir / "postgres-data") if own else None
        # Home 0 is the catalog (self.postgres), home k > 0 the shard server self.shard_servers[k - 1].
        self.shard_servers = [EmbeddedPostgres(work_dir / f"postgres-shard-{k}") for k in range(1, shards)]
        self.shard_dsns: list[str] = []
        self.ranges = partition_ranges(shards)  # per home: (first, last), the catalog's first
        self.stopped_shards: set[int] = set()
        self.dsn = database_url or ""
        self.api_url = ""
        self.members: dict[str, Member] = {}
        self.env: dict[str, str] = {}  # the roles' environment (the CLI commands the harness runs get it too)
        self.exits: list[Exit] = []

    @property
    def schedulers(self) -> list[str]:
        return [name for name in self.members if name.startswith("scheduler")]

    @property
    def workers(self) -> list[str]:
        return [name for name in self.members if name.startswith("worker")]

    @property
    def target_host(self) -> str:
        """Where the HTTP target listens: an address every zone reaches."""
        return self.zones.host_address if self.zones is not None else "127.0.0.1"

    def start_database(self) -> str:
        """Blocking (initdb takes seconds): call it in a thread from async code."""
        if self.zones is not None:
            skewed_clock(self.zone_clock_skew)  # says what is missing before anything is made
            self.zones.make()
        if self.postgres is not None:
            self.dsn = self.postgres.acquire()
            self.shard_dsns = [server.acquire() for server in self.shard_servers]
        elif self.cluster is not None:
            self.cluster.start()
            self.dsn = self.cluster.database_url()
        return self.dsn

    @property
    def database(self) -> str:
        if self.cluster is not None and self.zones is not None:
            return (f"own Patroni cluster in {ZONES} zones ({len(self.cluster.postgres)} PostgreSQL, synchronous "
                    f"mode, 3 etcd; zone {SKEWED_ZONE}'s clock {self.zone_clock_skew:+g} s)")
        if self.cluster is not None:
            return f"own Patroni cluster ({len(self.cluster.postgres)} PostgreSQL, synchronous mode, 3 etcd)"
        if self.shard_servers:
            homes = ", ".join(f"{name} {first}-{last}" for name, (first, last) in zip(self.home_names, self.ranges,
                                                                                        strict=True))
            return f"own embedded PostgreSQL, {len(self.ranges)} servers (partitions: {homes})"
        return "own embedded PostgreSQL" if self.postgres is not None else "database given by URL"

    @property
    def home_dsns(self) -> list[str]:
        """The URL of each home: the catalog, then each shard."""
        return [self.dsn, *self.shard_dsns]

    @property
    def home_names(self) -> list[str]:
        return ["catalog", *(f"shard-{k}" for k in range(1, len(self.ranges)))]

    def home_of_partitions(self) -> list[int]:
        """For each partition, the index of its home (0: the catalog)."""
        homes = [0] * PARTITION_COUNT
        for home, (first, last) in enumerate(self.ranges):
            homes[first:last + 1] = [home] * (last - first + 1)
        return homes

    def stop_shard(self, home: int, stopped: bool = True) -> None:
        """SIGSTOP (or SIGCONT) the PostgreSQL of shard ``home`` (1..N-1): an outage in which its
        sessions stay open and nothing answers."""
        freeze_server(self.shard_servers[home - 1], stopped)
        if stopped:
            self.stopped_shards.add(home)
        else:
            self.stopped_shards.discard(home)

    def restart_database(self, mode: str) -> None:
        if self.postgres is None:
            raise RuntimeError("the database is not the harness's own: it cannot be restarted")
        restart_server(self.postgres, mode)

    def start_roles(self) -> None:
        logs = self.work_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "CHIMES_DATABASE_URL": self.dsn, "CHIMES_DATA_DIR": str(self.work_dir / "data"),
               "CHIMES_SECRET_KEY": Fernet.generate_key().decode(), "CHIMES_LOG_FORMAT": "json",
               "CHIMES_LOG_LEVEL": "INFO", "PYTHONUNBUFFERED": "1",
               "CHIMES_EGRESS_ALLOW_LOOPBACK": "true"}  # the target listens on 127.0.0.1
        self.env = env
        port = _free_port()
        self.api_url = f"http://127.0.0.1:{port}"
        shape = self.shape
        roles = {"api": ["api", "--host", "127.0.0.1", "--port", str(port), "--write-burst", "1000"]}
        for i in range(1, shape.schedulers + 1):
            roles[f"scheduler-{i}"] = ["scheduler", "--node-id", f"scheduler-{i}", "--lease-ttl", str(shape.lease_ttl)]
        for i in range(1, shape.workers + 1):
            roles[f"worker-{i}"] = ["worker", "--worker-id", f"worker-{i}", "--lease-sec", str(shape.worker_lease),
                                    "--concurrency", str(shape.worker_concurrency), "--shutdown-grace", "2"]
        for name, args in roles.items():
            zone = self.zone_of(name)
            prefix = self.zones.prefix(zone) if self.zones is not None and zone is not None else None
            clock = skewed_clock(self.zone_clock_skew) if prefix and zone == SKEWED_ZONE else {}
            self.members[name] = Member(name, args, env | clock, logs, prefix)
            self.members[name].start()

    def zone_of(self, member: str) -> int | None:
        """With zones, scheduler-N and worker-N live in zone N (spread round the zones beyond 3)."""
        if self.zones is None or member == "api":
            return None
        return (int(member.rsplit("-", 1)[1]) - 1) % ZONES + 1

    def supervise(self) -> list[Exit]:
        """Bring back members that exited without being killed on purpose (as systemd or Kubernetes
        would); each such exit is recorded."""
        found = []
        for member in self.members.values():
            if member.proc is not None and not member.alive and not member.down_on_purpose:
                found.append(Exit(member.name, member.proc.returncode, member.started, time.time(),
                                  member.log_tail()))
                member.start()
        self.exits += found
        return found

    def heal(self) -> None:
        """Every member running and awake (the end of the fault phase)."""
        for member in self.members.values():
            if not member.alive:
                member.start()
            elif member.frozen:
                member.thaw()
        if self.zones is not None:
            for zone in range(1, ZONES + 1):
                self.zones.heal(zone)
        if self.cluster is not None:
            for pg in self.cluster.postgres:
                pg.freeze(False)
            self.cluster.restart_dead()
        for home in sorted(self.stopped_shards):
            self.stop_shard(home, False)

    def database_crashes(self) -> list[tuple[float, float, str]]:
        """Crashes of the harness's own PostgreSQL that no fault caused (a server process killed by a
        signal, then crash recovery), from its log: (start, back up, the log line), epoch seconds."""
        if self.postgres is None:
            return []
        crashes: list[tuple[float, float, str]] = []
        for server in [self.postgres, *self.shard_servers]:
            crashed: tuple[float, str] | None = None
            with contextlib.suppress(FileNotFoundError), (server.pgdata / "server.log").open(
                    errors="replace") as log:
                for line in log:
                    if "was terminated by signal" in line:
                        crashed = (_log_time(line), line.strip())
                    elif crashed is not None and "ready to accept connections" in line:
                        crashes.append((crashed[0], _log_time(line), crashed[1]))
                        crashed = None
            if crashed is not None:
                crashes.append((crashed[0], crashed[0], crashed[1]))
        return crashes

    def count_in_logs(self, text: str) -> int:
        """Lines of every member's log (all its lives) that contain ``text``."""
        count = 0
        for member in self.members.values():
            with contextlib.suppress(FileNotFoundError), member.log_path.open(errors="replace") as log:
                count += sum(1 for line in log if text in line)
        return count

    def stop(self) -> None:
        for member in self.members.values():
            member.thaw()
            if member.alive and member.proc is not None:
                member.proc.send_signal(signal.SIGTERM)
        for home in sorted(self.stopped_shards):
            with contextlib.suppress(Exception):  # stopping must go on: the servers are released below
                self.stop_shard(home, False)
        for member in self.members.values():
            member.terminate()
        for server in self.shard_servers:
            server.release()
        if self.postgres is not None:
            self.postgres.release()
        if self.cluster is not None:
            if self.zones is not None:
                for zone in range(1, ZONES + 1):
                    self.zones.heal(zone)
            self.cluster.stop()
        if self.zones is not None:
            self.zones.remove()


def partition_ranges(homes: int) -> list[tuple[int, int]]:
    """The 1,024 partitions split evenly between ``homes`` databases, in order (the catalog's first)."""
    bounds = [home * PARTITION_COUNT // homes for home in range(homes + 1)]
    return [(bounds[home], bounds[home + 1] - 1) for home in range(homes)]


def _log_time(line: str) -> float:
    """The time a PostgreSQL log line starts with (``2026-11-30 01:38:41.879 UTC ...``)."""
    stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S.%f")
    return stamp.replace(tzinfo=UTC).timestamp()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
