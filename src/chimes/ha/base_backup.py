"""``chimes ha backup`` on PostgreSQL's own tools: a base backup of the Patroni cluster with
``pg_basebackup``, from a streaming standby when there is one (the primary only serves its WAL),
checked with ``pg_verifybackup`` before it counts, then retention (chimes.ha.repository).

The copy is made in a hidden folder; once verified it takes its name, ``base/<UTC time>``. One that
fails verification is renamed ``base/<UTC time>.failed`` with the reason in its ``backup.json``:
the command fails, naming it, and restores and retention never count it as a backup.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import fasteners

from chimes.ha.repository import (
    FAILED_SUFFIX,
    MANIFEST,
    STAMP,
    BaseBackup,
    Repository,
    Retention,
    ToolFailed,
    run_tool,
    start_wal_of,
)

if TYPE_CHECKING:
    from chimes.ha.cluster import HaCluster, PatroniMember


class BackupFailed(RuntimeError):
    """No verified backup was made; the message says why and what is left in the repository."""


@dataclass(frozen=True)
class BackupTaken:
    backup: BaseBackup
    role: str  # the member's role when it was copied: replica, sync_standby or primary
    retention: Retention
    wal_files_removed: int


def take(cluster: HaCluster, keep: int) -> BackupTaken:
    """A verified base backup of ``cluster`` into its repository, then all but the ``keep`` newest
    verified backups removed with the WAL only they needed."""
    repo = cluster.repository
    if repo is None:
        raise BackupFailed(f"the cluster in {cluster.base} archives no WAL with PostgreSQL's tools: start it once "
                           f"with chimes ha up --backup-repo DIR")
    member, role = source(cluster)
    repo.prepare([m.name for m in cluster.postgres])
    with fasteners.InterProcessLock(str(repo.path / ".backup.lock")):
        backup = _copy_and_verify(cluster, repo, member)
        retention, removed = repo.prune(keep)
    return BackupTaken(backup, role, retention, removed)


def source(cluster: HaCluster) -> tuple[PatroniMember, str]:
    """A streaming standby (the synchronous one last: it is the one commits wait for), else the primary."""
    states = {state.get("name"): state for state in cluster.members()}
    standbys = [m for m in cluster.postgres
                if states.get(m.name, {}).get("role") in ("replica", "sync_standby")
                and states[m.name].get("state") == "streaming"]
    standbys.sort(key=lambda m: states[m.name]["role"] == "sync_standby")
    if standbys:
        return standbys[0], states[standbys[0].name]["role"]
    primary = cluster.primary()
    if primary is None:
        raise BackupFailed(f"no member of the cluster in {cluster.base} answers as primary or streaming standby "
                           f"(is chimes ha up running?)")
    return primary, "primary"


def _copy_and_verify(cluster: HaCluster, repo: Repository, member: PatroniMember) -> BaseBackup:
    partial = begin(repo)
    started = datetime.now(UTC)
    try:
        copy(partial, ["-h", member.layout.host, "-p", str(member.layout.client_port), "-U", "replicator"],
             cluster.layout.replication_password)
    except (ToolFailed, OSError) as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise BackupFailed(f"the base backup from {member.name} failed, nothing was kept: {exc}") from None
    return finish(repo, partial, started, datetime.now(UTC), member.name)


def begin(repo: Repository) -> Path:
    """The hidden folder a base backup is copied into, the PostgreSQL user's."""
    partial = repo.base / f".partial-{datetime.now(UTC).strftime(STAMP)}-{os.getpid()}"
    partial.mkdir(mode=0o700)
    repo.give_to_run_as_user(partial)
    return partial


def copy(partial: Path, connection: list[str], password: str) -> None:
    """``pg_basebackup`` of the server ``connection`` names (``-h``, ``-p``, ``-U``) into ``partial/data``:
    plain files with their manifest, and the WAL that makes them consistent streamed beside."""
    run_tool("pg_basebackup", [*connection, "-w", "-D", str(partial / "data"), "-F", "p", "-X", "stream",
                               "-c", "fast", "-l", f"chimes ha backup {partial.name}"], password=password)


def finish(repo: Repository, partial: Path, started: datetime, finished: datetime, member: str) -> BaseBackup:
    """Verify the copy in ``partial`` and give it its name: ``base/<started>``, or ``base/<started>.failed``
    (and BackupFailed) when ``pg_verifybackup`` fails it."""
    error = None
    try:
        run_tool("pg_verifybackup", ["-q", str(partial / "data")])
    except ToolFailed as exc:
        error = str(exc)
    name = started.strftime(STAMP) + (FAILED_SUFFIX if error else "")
    backup = BaseBackup(repo.base / name, started, finished, member, start_wal_of(partial / "data"), error)
    (partial / MANIFEST).write_text(json.dumps(
        {"started": started.isoformat(), "finished": finished.isoformat(), "member": member,
         "startWal": backup.start_wal, **({"error": error} if error else {})}, indent=2) + "\n")
    if backup.folder.exists():  # two backups begun in the same second
        shutil.rmtree(partial)
        raise BackupFailed(f"{backup.folder} exists already: take the backup again")
    partial.rename(backup.folder)
    if error:
        raise BackupFailed(f"the base backup from {member} failed verification and does not count (kept as "
                           f"{backup.folder} to be looked at): {error}")
    return backup
