"""A Patroni-managed PostgreSQL cluster with its etcd, as processes on this machine.

Three etcd members keep the leader lock; two or three PostgreSQL servers (the embedded binaries)
each run under their own Patroni, in synchronous mode: a commit is acknowledged only once a standby
has it, so a failover loses nothing that was acknowledged. Every member listens on its own port of
``host`` (127.0.0.1, or an address inside a network namespace made by a test). The layout, ports and
generated passwords are kept in ``<base>/ha.json``, so the same folder starts the same cluster again.

Members can be killed (SIGKILL: the host is gone), frozen (SIGSTOP: the host stalls) and started
again; a former primary started again rejoins as a standby through ``pg_rewind``.

With a backup repository, every member archives its WAL there (chimes.ha.repository, or pgBackRest's
repository with ``BackupTool.PGBACKREST``); ``chimes ha backup`` and ``chimes ha restore`` work on it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import secrets
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import psutil

from chimes.ha import runtime
from chimes.ha.pgbackrest import Member, PgBackRest, patroni_settings
from chimes.ha.repository import Repository, archive_settings
from chimes.store.embedded import DATABASE, SERVER_SETTINGS

log = logging.getLogger(__name__)

# Patroni's timing: the leader lock lasts TTL seconds unrenewed; loop_wait + 2 * retry_timeout must
# stay under it. A dead primary is replaced about TTL + loop_wait after its last renewal.
PATRONI_TTL = 20
PATRONI_LOOP_WAIT = 1
PATRONI_RETRY_TIMEOUT = 5
RESTORE_METHOD = "chimes_restore"  # Patroni's bootstrap.method while chimes ha restore rebuilds the cluster
RESTORE_SCRIPT = "restore_bootstrap.py"  # its command, copied into the member's folder (chimes.ha.restore_bootstrap)
ARCHIVE_AT_STOP_SEC = 30.0  # how long a clean stop waits for the primary's last WAL to be archived


class BackupTool(StrEnum):
    """What archives the WAL and takes the backups of a cluster with a backup repository."""

    POSTGRES = "postgres"  # PostgreSQL's own: archive_command, pg_basebackup, pg_verifybackup (chimes.ha.repository)
    PGBACKREST = "pgbackrest"  # pgBackRest, where its version supports the server's PostgreSQL


@dataclass(frozen=True)
class RestorePlan:
    """While ``chimes ha restore`` runs: the member it bootstraps restores ``backup`` (a base backup's
    data folder) and replays the archive up to ``to_time``."""

    backup: Path
    to_time: datetime


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class MemberLayout:
    name: str
    host: str
    client_port: int  # etcd: client port; PostgreSQL: its port
    peer_port: int  # etcd: peer port; Patroni: its REST API port


@dataclass
class Layout:
    """What ``ha.json`` keeps: where each member listens, and the generated passwords."""

    etcd: list[MemberLayout]
    postgres: list[MemberLayout]
    superuser_password: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    replication_password: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    rewind_password: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    backup_repo: str | None = None  # the backup repository, when WAL is archived (chimes ha up --backup-repo)
    backup_tool: str = BackupTool.POSTGRES

    @classmethod
    def new(cls, hosts: Sequence[str], postgres: int) -> Layout:
        """Three etcd members and ``postgres`` servers, spread over ``hosts`` in turn (a zone each).
        On one address every member needs ports of its own; on an address per zone (one member of
        each kind on it, in a network namespace) the usual ports do."""
        spread = len(hosts) >= max(3, postgres)
        etcd = [MemberLayout(f"etcd{i + 1}", h, *((2379, 2380) if spread else (free_port(h), free_port(h))))
                for i, h in enumerate(hosts[i % len(hosts)] for i in range(3))]
        pg = [MemberLayout(f"pg{i + 1}", h, *((5432, 8008) if spread else (free_port(h), free_port(h))))
              for i, h in enumerate(hosts[i % len(hosts)] for i in range(postgres))]
        return cls(etcd, pg)

    @classmethod
    def load(cls, path: Path) -> Layout:
        data = json.loads(path.read_text())
        if data.get("backup_repo") and "backup_tool" not in data:
            data["backup_tool"] = BackupTool.PGBACKREST  # the only tool of the versions that wrote no backup_tool
        return cls(**{**data, "etcd": [MemberLayout(**m) for m in data["etcd"]],
                      "postgres": [MemberLayout(**m) for m in data["postgres"]]})

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))
        path.chmod(0o600)


class Process:
    """One member's process: started in a session of its own, killed or frozen on purpose."""

    def __init__(self, name: str, log_path: Path, prefix: Sequence[str] = ()) -> None:
        self.name = name
        self.log_path = log_path
        self.prefix = list(prefix)  # e.g. `ip netns exec ZONE`: where the member runs (it must exec the command)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def launch(self, command: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen([*self.prefix, *command], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, cwd=cwd, start_new_session=True)

    def signal(self, sig: int) -> None:
        if self.alive and self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(10)


class EtcdMember(Process):
    def __init__(self, layout: MemberLayout, base: Path, cluster: str, prefix: Sequence[str] = ()) -> None:
        super().__init__(layout.name, base / f"{layout.name}.log", prefix)
        self.layout = layout
        self.data_dir = base / layout.name
        self.cluster = cluster

    def pids(self) -> list[int]:
        """The etcd on this member's data dir, also when another process started it."""
        data_dir = str(self.data_dir)
        found = []
        for process in psutil.process_iter(["cmdline"]):
            command = process.info["cmdline"] or []
            if any(a == "--data-dir" and b == data_dir for a, b in itertools.pairwise(command)):
                found.append(process.pid)
        return found

    @property
    def client_url(self) -> str:
        return f"http://{self.layout.host}:{self.layout.client_port}"

    def start(self) -> None:
        peer = f"http://{self.layout.host}:{self.layout.peer_port}"
        state = "existing" if (self.data_dir / "member").exists() else "new"
        self.launch([runtime.etcd_binary(), "--name", self.name, "--data-dir", str(self.data_dir),
                     "--listen-client-urls", self.client_url, "--advertise-client-urls", self.client_url,
                     "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                     "--initial-cluster", self.cluster, "--initial-cluster-state", state,
                     "--initial-cluster-token", "chimes-ha", "--log-level", "warn"])


class PatroniMember(Process):
    """A PostgreSQL server under its Patroni. The REST API (``peer_port``) tells its role."""

    def __init__(self, layout: MemberLayout, base: Path, cluster: HaCluster, prefix: Sequence[str] = ()) -> None:
        super().__init__(layout.name, base / f"{layout.name}.log", prefix)
        self.layout = layout
        self.dir = base / layout.name
        self.cluster = cluster

    @property
    def api_url(self) -> str:
        return f"http://{self.layout.host}:{self.layout.peer_port}"

    @property
    def data_dir(self) -> Path:
        return self.dir / "data"

    def start(self) -> None:
        self.dir.mkdir(exist_ok=True)
        (self.dir / "run").mkdir(exist_ok=True)
        config = self.dir / "patroni.yml"
        config.write_text(json.dumps(self.cluster.patroni_config(self), indent=2))  # JSON is YAML
        config.chmod(0o600)
        _give_to_run_as_user(self.dir)
        env = {**os.environ, "PYTHONPATH": str(self.cluster.patroni_site), "HOME": str(self.dir)}
        self.launch(runtime.as_user([self.cluster.python, "-m", "patroni", str(config)]), env=env, cwd=self.dir)

    def postmaster_pid(self) -> int | None:
        """The pid postmaster.pid names, while that process is the server that wrote it: a SIGKILLed
        server leaves the file behind, and its pid may be another process's by now (Patroni compares
        the start time in the file with the process's, as here)."""
        try:
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
            pid, started = int(lines[0]), int(lines[2])
            return pid if abs(psutil.Process(pid).create_time() - started) <= 3 else None
        except (OSError, ValueError, IndexError, psutil.Error):
            return None

    def pids(self) -> list[int]:
        """Patroni's pid, the postmaster's and its backends', also when another process started them
        (``chimes ha up``): everything that runs on the member's host."""
        config = str(self.dir / "patroni.yml")
        found = [p.pid for p in psutil.process_iter(["cmdline"]) if config in (p.info["cmdline"] or [])]
        postmaster = self.postmaster_pid()
        if postmaster is not None:  # Process(None) would be this process: kill() must never reach it
            with contextlib.suppress(psutil.Error):
                server = psutil.Process(postmaster)
                found += [server.pid] + [child.pid for child in server.children(recursive=True)]
        return found

    def kill(self) -> None:
        """SIGKILL Patroni and its PostgreSQL: the host is gone, nothing is flushed or handed over."""
        self._signal_all(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def freeze(self, frozen: bool = True) -> None:
        """SIGSTOP (or SIGCONT) Patroni and the postmaster: a host that stalls without going away."""
        self._signal_all(signal.SIGSTOP if frozen else signal.SIGCONT)

    def _signal_all(self, sig: int) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def state(self, timeout: float = 2.0) -> dict[str, Any] | None:
        """Patroni's view of this member (``role``: primary, replica; ``timeline``), or None."""
        try:
            state: dict[str, Any] = httpx.get(f"{self.api_url}/patroni", timeout=timeout).json()
            return state
        except (httpx.HTTPError, ValueError):
            return None


class HaCluster:
    """etcd and Patroni members under ``base``; :meth:`start` brings them up and waits for a primary."""

    def __init__(self, base: Path, *, postgres: int = 3, hosts: Sequence[str] = ("127.0.0.1",),
                 allowed_networks: Sequence[str] = ("127.0.0.1/32",),
                 prefixes: dict[str, Sequence[str]] | None = None, synchronous_mode: bool = True,
                 backup_repo: Path | None = None, backup_tool: BackupTool | None = None) -> None:
        """``hosts``: the addresses members listen on, in turn; ``prefixes``: per address, the command
        that runs a member there (``ip netns exec ZONE`` for a zone made by a test). ``synchronous_mode``
        off makes every standby asynchronous, a setup Chimes does not support: it is there to measure
        what it costs and loses (``python -m bench ha-cost``, ``async-loss``); it applies when the
        cluster is first bootstrapped. ``backup_repo``: archive every member's WAL into that repository and
        take backups there, with ``backup_tool`` (PostgreSQL's own tools unless ``ha.json`` says otherwise);
        both are kept in ``ha.json``, so later starts of the folder go on archiving."""
        self.synchronous_mode = synchronous_mode
        self.base = base.resolve()
        self.base.mkdir(parents=True, exist_ok=True)
        state = self.base / "ha.json"
        if state.exists():
            self.layout = Layout.load(state)
        else:
            self.layout = Layout.new(hosts, postgres)
            self.layout.save(state)
        repo = None if backup_repo is None else str(backup_repo.expanduser().resolve())
        tool = self.layout.backup_tool if backup_tool is None else backup_tool
        if (repo is not None and repo != self.layout.backup_repo) or tool != self.layout.backup_tool:
            self.layout.backup_repo = repo or self.layout.backup_repo
            self.layout.backup_tool = tool
            self.layout.save(state)
        self.allowed_networks = list(allowed_networks)
        initial = ",".join(f"{m.name}=http://{m.host}:{m.peer_port}" for m in self.layout.etcd)
        where = prefixes or {}
        self.etcd = [EtcdMember(m, self.base, initial, where.get(m.host, ())) for m in self.layout.etcd]
        self.postgres = [PatroniMember(m, self.base, self, where.get(m.host, ())) for m in self.layout.postgres]
        self.patroni_site = self.base / "patroni-site"
        self.python = ""
        repo_path = None if self.layout.backup_repo is None else Path(self.layout.backup_repo)
        self.pgbackrest = PgBackRest(self.base, repo_path) \
            if repo_path is not None and self.layout.backup_tool == BackupTool.PGBACKREST else None
        self.repository = Repository(repo_path) \
            if repo_path is not None and self.layout.backup_tool == BackupTool.POSTGRES else None
        self.restoring: RestorePlan | None = None  # set by chimes ha restore (chimes.ha.restore) while it runs

    # --- the URL every Chimes role is given ---------------------------------------------------------
    def database_url(self, database: str = DATABASE) -> str:
        """Every PostgreSQL member, the primary found by ``target_session_attrs=read-write``."""
        hosts = ",".join(f"{m.host}:{m.client_port}" for m in self.layout.postgres)
        password = quote(self.layout.superuser_password, safe="")
        return f"postgresql://postgres:{password}@{hosts}/{database}?target_session_attrs=read-write"

    # --- lifecycle -------------------------------------------------------------------------------
    def prepare(self) -> None:
        """What the members need before they start: etcd, Patroni and its interpreter, the backup repository."""
        runtime.etcd_binary()
        self.python = runtime.patroni_python()
        runtime.ensure_patroni(self.patroni_site)
        if self.pgbackrest is not None:
            self.pgbackrest.write_config(self.backup_members())
        if self.repository is not None:
            self.repository.prepare([m.name for m in self.postgres])

    def start(self, timeout: float = 180.0) -> None:
        self.prepare()
        for etcd in self.etcd:
            etcd.start()
        for patroni in self.postgres:
            patroni.start()
        primary = self.wait_for_primary(timeout)
        self.wait_for_standbys(timeout)
        self._create_database(primary)
        if self.pgbackrest is not None:
            self.pgbackrest.stanza_create(self.layout.superuser_password)

    def backup_members(self) -> list[Member]:
        return [Member(m.data_dir, m.layout.client_port, m.dir / "run") for m in self.postgres]

    def stop(self) -> None:
        """A clean stop: the standbys first, so that none is promoted when the primary's Patroni lets
        the leader lock go, then the primary, then etcd. With a repository, the primary's last WAL is
        archived first, so that a restore loses nothing committed before the stop."""
        if self.repository is not None:
            self.archive_current_wal()
        primary = self.primary()
        for patroni in sorted(self.postgres, key=lambda member: member is primary):
            patroni.stop()
        for etcd in self.etcd:
            etcd.stop()

    def archive_current_wal(self, timeout: float = ARCHIVE_AT_STOP_SEC) -> str | None:
        """Close the primary's current WAL segment and wait until it is archived; returns the segment,
        or None (logged) when no primary answers or the archive did not take it within ``timeout``."""
        import asyncio

        from chimes.store.cluster import archive_current_wal

        primary = self.primary()
        if primary is None:
            log.warning("no primary answers: the WAL written since the last archived segment is not archived")
            return None
        try:
            return asyncio.run(archive_current_wal(primary.layout.host, primary.layout.client_port,
                                                   self.layout.superuser_password, timeout))
        except (OSError, RuntimeError) as exc:  # TimeoutError is an OSError
            log.warning("the primary's last WAL segment was not archived: %s", exc)
            return None

    def running(self) -> list[str]:
        """The members whose processes run on this machine, also when another process started them."""
        etcd = [m.name for m in self.etcd if m.alive or m.pids()]
        return etcd + [m.name for m in self.postgres if m.alive or m.pids()]

    def restart_dead(self) -> list[str]:
        """Start every member that is not running (a killed former primary rejoins as a standby)."""
        started = []
        members: list[EtcdMember | PatroniMember] = [*self.etcd, *self.postgres]
        for member in members:
            if not member.alive:
                member.start()
                started.append(member.name)
        return started

    # --- what the cluster looks like ---------------------------------------------------------------
    def primary(self) -> PatroniMember | None:
        for member in self.postgres:  # asked over the REST API: also from a process that did not start them
            state = member.state(timeout=1.0)
            if state is not None and state.get("role") in ("primary", "master") and state.get("state") == "running":
                return member
        return None

    def wait_for_primary(self, timeout: float, *, other_than: PatroniMember | None = None,
                         after_timeline: int | None = None) -> PatroniMember:
        """A running primary: another member than ``other_than``, or one promoted since ``after_timeline``
        (each promotion starts a new timeline)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            primary = self.primary()
            newer = after_timeline is None or (
                primary is not None and (primary.state() or {}).get("timeline", 0) > after_timeline)
            if primary is not None and primary is not other_than and newer:
                return primary
            time.sleep(0.1)
        raise TimeoutError(f"no PostgreSQL primary within {timeout:g} s; logs in {self.base}")

    def wait_for_standbys(self, timeout: float) -> None:
        """Every running member other than the primary streams from it, and one is the synchronous
        standby (the one a commit waits for, and the one a switchover may go to) in synchronous mode."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            members = self.members()
            running = [m for m in members if m.get("state") in ("running", "streaming")]
            standbys = [m for m in running if m.get("role") in ("replica", "sync_standby")]
            alive = sum(1 for m in self.postgres if m.alive)
            if (len(running) == alive and len(standbys) == alive - 1
                    and all(m.get("state") == "streaming" for m in standbys)
                    and (alive < 2 or not self.synchronous_mode
                         or any(m.get("role") == "sync_standby" for m in standbys))
                    and self._standbys_say_streaming()):
                return
            time.sleep(0.2)
        raise TimeoutError(f"standbys not streaming within {timeout:g} s; logs in {self.base}")

    def _standbys_say_streaming(self) -> bool:
        """Each running member agrees, from its own REST API, on the primary's timeline and, but the
        primary, streams from it: the list above is read from one member, whose view may be stale (a
        member just back from a cut zone still reports what it saw before)."""
        states = [state for member in self.postgres if member.alive and (state := member.state(timeout=1.0))]
        primaries = [state for state in states if state.get("role") in ("primary", "master")]
        if len(primaries) != 1:
            return False
        timeline = primaries[0].get("timeline")
        return all(state.get("timeline") == timeline and state.get("replication_state", "streaming") == "streaming"
                   for state in states if state is not primaries[0])

    def members(self) -> list[dict[str, Any]]:
        """Patroni's list of members (``GET /cluster``) from any member that answers."""
        for member in self.postgres:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                members: list[dict[str, Any]] = httpx.get(f"{member.api_url}/cluster", timeout=1).json().get(
                    "members", [])
                return members
        return []

    def switchover(self, candidate: PatroniMember | None = None) -> PatroniMember:
        """A planned switchover through Patroni's REST API, as ``patronictl switchover`` does."""
        primary = self.wait_for_primary(30)
        body: dict[str, str] = {"leader": primary.name}
        if candidate is not None:
            body["candidate"] = candidate.name
        answer = httpx.post(f"{primary.api_url}/switchover", json=body, timeout=60)
        if answer.status_code != 200:
            raise RuntimeError(f"switchover refused: {answer.status_code} {answer.text}")
        return self.wait_for_primary(60, other_than=primary)

    # --- configuration ---------------------------------------------------------------------------
    def patroni_config(self, member: PatroniMember) -> dict[str, Any]:
        layout = member.layout
        hba = ["local all all scram-sha-256"]
        for network in self.allowed_networks:
            hba += [f"host replication replicator {network} scram-sha-256",
                    f"host all all {network} scram-sha-256"]
        parameters: dict[str, Any] = {key: value.strip("'") for key, value in SERVER_SETTINGS.items()
                                      if key not in ("listen_addresses",)}
        archiving: dict[str, Any] = {}
        if self.pgbackrest is not None:
            archiving = patroni_settings(self.pgbackrest.config)
        if self.repository is not None:
            archiving = archive_settings(self.repository.path, member.name, always=self.restoring is None)
        parameters.update(archiving.pop("parameters", {}))
        return {
            "scope": "chimes",
            "name": member.name,
            "log": {"level": "INFO"},
            "restapi": {"listen": f"{layout.host}:{layout.peer_port}",
                        "connect_address": f"{layout.host}:{layout.peer_port}"},
            "etcd3": {"hosts": [f"{m.host}:{m.client_port}" for m in self.layout.etcd]},
            "bootstrap": {
                "dcs": {
                    "ttl": PATRONI_TTL, "loop_wait": PATRONI_LOOP_WAIT, "retry_timeout": PATRONI_RETRY_TIMEOUT,
                    # A commit is acknowledged once a standby has it: a failover loses no acknowledged write.
                    "synchronous_mode": self.synchronous_mode,
                    "postgresql": {"use_pg_rewind": True,
                                   "parameters": {"wal_log_hints": "on", "max_connections": 300,
                                                  "max_wal_senders": 10, "max_replication_slots": 10}},
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}, {"auth": "scram-sha-256"}],
                **self._restore_bootstrap(member, archiving.get("recovery_conf", {})),
            },
            "postgresql": {
                "listen": f"{layout.host}:{layout.client_port}",
                "connect_address": f"{layout.host}:{layout.client_port}",
                "data_dir": str(member.data_dir),
                "bin_dir": str(_postgres_bin()),
                "pgpass": str(member.dir / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres", "password": self.layout.superuser_password},
                    "replication": {"username": "replicator", "password": self.layout.replication_password},
                    "rewind": {"username": "rewinder", "password": self.layout.rewind_password},
                },
                "parameters": {**parameters, "unix_socket_directories": str(member.dir / "run")},
                "pg_hba": hba,
                **archiving,
            },
        }

    def _restore_bootstrap(self, member: PatroniMember, recovery: dict[str, Any]) -> dict[str, Any]:
        """While chimes ha restore runs, Patroni bootstraps the cluster by its custom method instead of
        initdb: the script copies the base backup in (chimes.ha.restore_bootstrap), then PostgreSQL
        replays the archive up to the target and promotes itself, which a target the archive does not
        reach prevents (the server stops; Patroni gives up the bootstrap)."""
        if self.restoring is None:
            return {}
        script = member.dir / RESTORE_SCRIPT
        return {"method": RESTORE_METHOD, RESTORE_METHOD: {
            "command": f"{shlex.quote(self.python)} {shlex.quote(str(script))}",
            "backup": str(self.restoring.backup),
            "recovery_conf": {**recovery,
                              "recovery_target_time": self.restoring.to_time.astimezone(UTC).isoformat(),
                              "recovery_target_timeline": "latest",
                              "recovery_target_action": "promote"}}}

    def _create_database(self, primary: PatroniMember) -> None:
        """Patroni makes only ``postgres``; Chimes keeps its tables in their own database."""
        import asyncio

        from chimes.store.cluster import create_replicated_database

        asyncio.run(create_replicated_database(primary.layout.host, primary.layout.client_port,
                                               self.layout.superuser_password, DATABASE))


def _postgres_bin() -> Path:
    from chimes.store.embedded import BIN_DIR

    runtime.allow_traversal(BIN_DIR)
    return BIN_DIR


def _give_to_run_as_user(folder: Path) -> None:
    """The member's folder belongs to the PostgreSQL user, private to it (PostgreSQL insists on 0700)."""
    user = runtime.run_as()
    folder.chmod(0o700)
    if user is None:
        return
    import pwd

    entry = pwd.getpwnam(user)
    runtime.allow_traversal(folder)
    for path in [folder, *folder.rglob("*")]:
        if path.stat().st_uid != entry.pw_uid:
            os.chown(path, entry.pw_uid, entry.pw_gid)
