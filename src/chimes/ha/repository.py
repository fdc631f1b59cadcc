"""The backup repository of a Patroni cluster on PostgreSQL's own tools: every member's archived WAL,
the verified base backups, and what retention keeps of them.

A repository ``REPO`` holds:

- ``wal/<member>/``: the WAL segments and timeline history files that member archived;
- ``base/<UTC time>/``: a base backup that ``pg_verifybackup`` passed: ``data/``, ``pg_basebackup``'s
  plain copy with its ``backup_manifest`` and the WAL that makes it consistent, and ``backup.json``;
- ``base/<UTC time>.failed/``: one that failed verification, kept to be looked at, never restored from;
- ``base/.partial-*``: one being taken, which nothing reads.

Every member archives (``archive_mode = always``), each into a folder of its own. A standby archives
each segment it receives, so the segments a lost primary completed but had not archived yet are
archived by the standby that has them; with ``archive_mode = on`` a standby marks what it receives as
done and archives nothing, and such a segment would be a gap that no replay crosses. Two members'
copies of a segment hold the same WAL but may differ past a segment switch (a recycled file keeps its
old bytes after the switch record), so a shared folder, whose archive command accepts only an
identical copy, would stall the second member's archiver: in folders of their own, names never
collide. ``restore_command`` reads the member's own folder first, then every other.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from chimes.ha import runtime
from chimes.store.embedded import ARCHIVE_TIMEOUT_SEC, BIN_DIR, UNSAFE_IN_COMMAND, archive_command

WAL = "wal"
BASE = "base"
MANIFEST = "backup.json"
FAILED_SUFFIX = ".failed"
STAMP = "%Y%m%dT%H%M%SZ"
#: How many verified base backups ``chimes ha backup`` keeps by default, with the WAL they need.
KEEP = 2

_START_WAL = re.compile(r"^START WAL LOCATION: .* \(file ([0-9A-F]{24})\)$", re.MULTILINE)


@dataclass(frozen=True)
class BaseBackup:
    """A base backup in the repository, as its ``backup.json`` describes it."""

    folder: Path
    started: datetime
    finished: datetime  # the copy was consistent no later than this: the earliest time it restores to
    member: str  # the member it was copied from
    start_wal: str  # the first WAL segment it needs (its backup_label's START WAL LOCATION)
    error: str | None = None  # why pg_verifybackup failed it; None: verified

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def data(self) -> Path:
        return self.folder / "data"

    @property
    def verified(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Retention:
    """What pruning removes: these base backups, and every archived WAL segment older than
    ``first_wal_kept`` (None: no WAL)."""

    remove: tuple[BaseBackup, ...]
    first_wal_kept: str | None


def plan_retention(backups: Sequence[BaseBackup], keep: int) -> Retention:
    """Keep the ``keep`` newest verified backups. The older verified ones go, and the failed ones
    older than the oldest kept (a newer failed one stays to be looked at). WAL before the oldest kept
    backup's start restores nothing any more; with no verified backup, nothing is removed."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, not {keep}")
    ordered = sorted(backups, key=lambda backup: backup.started)
    verified = [backup for backup in ordered if backup.verified]
    if not verified:
        return Retention((), None)
    kept = verified[-keep:]
    oldest = kept[0]
    remove = [backup for backup in ordered if backup.started < oldest.started]
    return Retention(tuple(remove), oldest.start_wal)


def start_wal_of(data: Path) -> str:
    """The first WAL segment a base backup needs, from its backup_label."""
    found = _START_WAL.search((data / "backup_label").read_text())
    if found is None:
        raise ValueError(f"{data / 'backup_label'} names no START WAL LOCATION")
    return found.group(1)


def restore_command(repo: Path, member: str) -> str:
    """The shell command that fetches ``%f`` for ``member``: from its own folder first (a copy it
    archived itself is the one it would archive again), then from any other member's."""
    wal = repo / WAL
    return (f"for d in \"{wal / member}\" \"{wal}\"/*; do if test -f \"$d/%f\"; then exec cp \"$d/%f\" \"%p\"; "
            f"fi; done; exit 1")


def archive_settings(repo: Path, member: str, *, always: bool = True) -> dict[str, Any]:
    """What a member's Patroni ``postgresql`` section gets. ``always`` off (``archive_mode = on``)
    is for a member replaying a restore: it archives its new timeline once promoted, not the segments
    it reads from the archive."""
    return {"parameters": {"archive_mode": "always" if always else "on", "archive_timeout": ARCHIVE_TIMEOUT_SEC,
                           "archive_command": archive_command(repo / WAL / member)},
            "recovery_conf": {"restore_command": restore_command(repo, member)}}


class Repository:
    """A backup repository (another disk in practice), read and written by the PostgreSQL user: the
    members' archive commands write into it as that user."""

    def __init__(self, path: Path) -> None:
        self.path = path.expanduser().resolve()
        if any(char in str(self.path) for char in UNSAFE_IN_COMMAND):
            raise ValueError(f"the backup repository {self.path} may not contain any of {UNSAFE_IN_COMMAND}")
        self.wal = self.path / WAL
        self.base = self.path / BASE

    def prepare(self, members: Sequence[str]) -> None:
        """The folders, private (0700), owned by the PostgreSQL user."""
        for folder in (self.path, self.wal, self.base, *(self.wal / member for member in members)):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.give_to_run_as_user(self.path)

    def backups(self) -> list[BaseBackup]:
        """Every base backup, verified or failed, oldest first; ones being taken are left out."""
        found = []
        for folder in sorted(self.base.glob("[0-9]*")) if self.base.is_dir() else []:
            manifest = folder / MANIFEST
            if not manifest.is_file():
                continue
            data = json.loads(manifest.read_text())
            found.append(BaseBackup(folder, datetime.fromisoformat(data["started"]),
                                    datetime.fromisoformat(data["finished"]), data["member"], data["startWal"],
                                    data.get("error")))
        return sorted(found, key=lambda backup: backup.started)

    def archived_segments(self) -> list[Path]:
        """Every archived file of every member (segments, history files, a promoted member's .partial)."""
        return [path for folder in sorted(self.wal.glob("*")) if folder.is_dir()
                for path in folder.iterdir() if not path.name.startswith(".")]

    def prune(self, keep: int) -> tuple[Retention, int]:
        """Apply :func:`plan_retention`; returns it and how many archived WAL files went."""
        plan = plan_retention(self.backups(), keep)
        for backup in plan.remove:
            shutil.rmtree(backup.folder)
        removed = 0
        if plan.first_wal_kept is not None:
            before = len(self.archived_segments())
            for folder in sorted(self.wal.glob("*")):
                if folder.is_dir():
                    # pg_archivecleanup compares segment numbers whatever the timeline, and keeps the timeline
                    # history files; -b removes the backup history files (*.backup) of older segments too.
                    run_tool("pg_archivecleanup", ["-b", str(folder), plan.first_wal_kept], as_user=False)
            removed = before - len(self.archived_segments())
        return plan, removed

    @staticmethod
    def give_to_run_as_user(top: Path) -> None:
        user = runtime.run_as()
        if user is None:
            return
        import pwd

        entry = pwd.getpwnam(user)
        runtime.allow_traversal(top)
        for path in [top, *top.rglob("*")]:
            if path.lstat().st_uid != entry.pw_uid:
                os.chown(path, entry.pw_uid, entry.pw_gid, follow_symlinks=False)


class ToolFailed(RuntimeError):
    """A PostgreSQL program exited non-zero; the message holds what it said."""


def run_tool(program: str, args: list[str], *, password: str | None = None, as_user: bool = True,
             timeout: float = 3600) -> str:
    """One of the server's own programs, as the PostgreSQL user unless ``as_user`` is off (what it
    writes must be that user's, for the members to read it)."""
    runtime.allow_traversal(BIN_DIR)
    command = [str(BIN_DIR / program), *args]
    env = {**os.environ, **({"PGPASSWORD": password} if password is not None else {})}
    done = subprocess.run(runtime.as_user(command) if as_user else command, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    if done.returncode != 0:
        raise ToolFailed(f"{program} failed (exit {done.returncode}): {(done.stderr or done.stdout).strip()[-2000:]}")
    return done.stdout
