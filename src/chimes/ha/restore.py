"""``chimes ha restore``: the Patroni cluster rebuilt from a base backup and the archived WAL, as it
was at a point in time.

With the cluster stopped: the newest verified base backup finished by the target is verified again;
the cluster is removed from etcd (``patronictl remove``) and every member's data directory is set
aside; the first member is bootstrapped by Patroni's custom method (chimes.ha.restore_bootstrap
copies the backup in; PostgreSQL replays the archive up to the target and promotes itself) and becomes
the leader, on a new timeline; it is then stopped cleanly, and the other members are made standbys of
it when the cluster next starts (``chimes ha up``).

PostgreSQL promotes only once replay has reached the target: a gap in the archive, a damaged segment
or an archive that ends before the target stops the server instead. A restore that fails at any step
puts every data directory back and removes what it wrote to etcd, so the cluster is as it was.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from chimes.ha import restore_bootstrap
from chimes.ha.cluster import RESTORE_SCRIPT, HaCluster, PatroniMember, RestorePlan
from chimes.ha.repository import BaseBackup, Repository, ToolFailed, run_tool

SCOPE = "chimes"
FORGET_WAIT_SEC = 60.0  # a stopped leader's lock lapses within Patroni's TTL (20 s)
_SEGMENT = re.compile(r"^[0-9A-F]{24}$")
_REPLAY_END = re.compile(r"(recovery stopping .*|last completed transaction was at log time .*)")
_RESTORED = re.compile(r'restored log file "([0-9A-F]{24})" from archive')
_TROUBLE = re.compile(r"FATAL|PANIC|ERROR|recovery ended before|could not|invalid")


class RestoreFailed(RuntimeError):
    """The cluster was not restored (and is as it was); the message says why."""


@dataclass(frozen=True)
class ClusterRestored:
    backup: BaseBackup
    member: str  # the member bootstrapped from the backup, the leader when the cluster starts
    reached: str  # PostgreSQL's words on where replay stopped
    seconds: float
    set_aside: list[Path]  # the data directories of before, to delete once the restore is checked
    not_verified: list[tuple[BaseBackup, str]]  # newer backups passed over: pg_verifybackup failed them


def restore_cluster(cluster: HaCluster, to_time: datetime, *, timeout_sec: float = 3600.0,
                    say: Callable[[str], None] = print) -> ClusterRestored:
    """Rebuild ``cluster`` as it was at ``to_time`` (aware). The cluster must be stopped."""
    if to_time.tzinfo is None:
        raise ValueError("to_time needs a time zone")
    began = time.monotonic()
    repo = cluster.repository
    if repo is None:
        raise RestoreFailed(f"the cluster in {cluster.base} keeps no backups with PostgreSQL's tools (chimes ha up "
                            f"--backup-repo DIR); a pgBackRest repository is restored with pgBackRest "
                            f"(docs/high-availability.md)")
    running = cluster.running()
    if running:
        raise RestoreFailed(f"the cluster in {cluster.base} is running ({', '.join(running)}): stop chimes ha up "
                            f"first (its clean stop archives the last WAL), and every Chimes role on it")
    backup, not_verified = choose_backup(repo, to_time, say)
    check_archive_reaches(repo, to_time)
    cluster.prepare()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    first = cluster.postgres[0]
    set_aside: dict[str, Path] = {}
    for etcd in cluster.etcd:
        etcd.start()
    try:
        forget(cluster)
        for member in cluster.postgres:
            if member.data_dir.exists():
                set_aside[member.name] = member.data_dir.rename(member.dir / f"data.before-restore-{stamp}")
        say(f"restoring {first.name} from base backup {backup.name} (from {backup.member}, finished "
            f"{backup.finished.isoformat()}) and the archived WAL up to {to_time.isoformat()} ...")
        reached = _bootstrap(cluster, first, RestorePlan(backup.data, to_time), timeout_sec)
    except BaseException as exc:
        try:
            _put_back(cluster, first, set_aside, stamp)
        except OSError as undo:
            where = ", ".join(f"{name}: {path}" for name, path in set_aside.items())
            raise RestoreFailed(f"{exc}\nPutting the data directories back failed too ({undo}); those of before "
                                f"are in {where}") from None
        if isinstance(exc, RestoreFailed):
            raise RestoreFailed(f"{exc}\nNothing was changed: every data directory is back in place") from None
        raise
    finally:
        cluster.restoring = None
        for etcd in cluster.etcd:
            etcd.stop()
    return ClusterRestored(backup, first.name, reached, time.monotonic() - began, list(set_aside.values()),
                           not_verified)


def choose_backup(repo: Repository, to_time: datetime,
                  say: Callable[[str], None]) -> tuple[BaseBackup, list[tuple[BaseBackup, str]]]:
    """The newest verified base backup finished by ``to_time`` that ``pg_verifybackup`` passes again
    now; a newer one that fails is named and passed over."""
    backups = repo.backups()
    usable = [backup for backup in backups if backup.verified and backup.finished <= to_time]
    if not usable:
        verified = [backup for backup in backups if backup.verified]
        oldest = f"the oldest was finished at {verified[0].finished.isoformat()}" if verified else "there is none"
        raise RestoreFailed(f"no verified base backup in {repo.base} was finished by {to_time.isoformat()} ({oldest}): "
                            f"no backup restores to that time")
    not_verified = []
    for backup in reversed(usable):
        try:
            run_tool("pg_verifybackup", ["-q", str(backup.data)])
        except ToolFailed as exc:
            say(f"base backup {backup.name} fails verification now, passed over: {exc}")
            not_verified.append((backup, str(exc)))
            continue
        return backup, not_verified
    raise RestoreFailed(f"every base backup in {repo.base} finished by {to_time.isoformat()} fails verification: "
                        + "; ".join(f"{backup.name}: {why}" for backup, why in not_verified))


def check_archive_reaches(repo: Repository, to_time: datetime) -> None:
    """Refuse at once a target that no archived segment was written after: replay could not reach it.
    (A segment written after it may still end before it; then PostgreSQL refuses to promote.)"""
    segments = [path for path in repo.archived_segments() if _SEGMENT.match(path.name)]
    newest = max((path.stat().st_mtime for path in segments), default=None)
    if newest is None or newest <= to_time.timestamp():
        ended = "holds no segment" if newest is None else \
            f"was last written at {datetime.fromtimestamp(newest, UTC).isoformat()}"
        raise RestoreFailed(f"the WAL archive in {repo.wal} {ended}, not after {to_time.isoformat()}: nothing "
                            f"archived reaches that time")


def forget(cluster: HaCluster) -> None:
    """Remove the cluster from etcd (``patronictl remove``), so that Patroni bootstraps it anew. A
    leader lock left by a member that was not stopped cleanly must lapse first; patronictl then
    asks for the leader's name, and is asked again until it does not."""
    config = cluster.base / "patronictl.json"
    config.write_text(json.dumps({"scope": SCOPE, "etcd3": {"hosts": [f"{m.host}:{m.client_port}"
                                                                      for m in cluster.layout.etcd]}}))
    command = [cluster.python, "-c", "import sys; from patroni.ctl import ctl; sys.exit(ctl())",
               "-c", str(config), "remove", SCOPE]
    env = {"PYTHONPATH": str(cluster.patroni_site), "PATH": "/usr/bin:/bin"}
    deadline = time.monotonic() + FORGET_WAIT_SEC
    while True:
        done = subprocess.run(command, input=f"{SCOPE}\nYes I am aware\n", env=env, capture_output=True,
                              text=True, timeout=60, check=False)
        if done.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise RestoreFailed(f"patronictl remove {SCOPE} failed: {(done.stderr or done.stdout).strip()[-2000:]}")
        time.sleep(1.0)  # etcd starting, or a leader lock lapsing: patronictl has no way to wait for either


def _bootstrap(cluster: HaCluster, member: PatroniMember, plan: RestorePlan, timeout_sec: float) -> str:
    """Start ``member`` bootstrapping from ``plan``; wait until it leads the cluster; stop it cleanly."""
    shutil.copyfile(restore_bootstrap.__file__, member.dir / RESTORE_SCRIPT)
    offset = member.log_path.stat().st_size if member.log_path.exists() else 0
    cluster.restoring = plan
    member.start()
    deadline = time.monotonic() + timeout_sec
    while not _leads(cluster, member):
        if not member.alive:
            raise RestoreFailed(f"the restore failed: Patroni gave up the bootstrap of {member.name}; its log "
                                f"({member.log_path}) says:\n{_trouble(member.log_path, offset)}")
        if time.monotonic() > deadline:
            raise RestoreFailed(f"{member.name} did not become the leader within {timeout_sec:g} s; its log "
                                f"({member.log_path}) says:\n{_trouble(member.log_path, offset)}")
        time.sleep(0.5)  # Patroni's REST API says nothing until asked; one loop of it is a second
    reached = _where_replay_stopped(member.log_path, offset)
    member.stop()
    return reached


def _leads(cluster: HaCluster, member: PatroniMember) -> bool:
    """``member`` holds the leader key and runs: Patroni's bootstrap, replay and promotion are over."""
    return any(state.get("name") == member.name and state.get("role") == "leader" and state.get("state") == "running"
               for state in cluster.members())


def _put_back(cluster: HaCluster, member: PatroniMember, set_aside: dict[str, Path], stamp: str) -> None:
    """Undo a restore that failed: the bootstrapped member stopped, what it made moved away (Patroni
    renames a failed bootstrap's data directory to ``data.failed``), the data directories of before
    back in place, and the cluster removed from etcd again."""
    member.stop()
    for each in cluster.postgres:
        for made in (each.data_dir, each.dir / "data.failed"):
            if made.exists():
                made.rename(each.dir / f"{made.name}.restore-{stamp}")
        aside = set_aside.get(each.name)
        if aside is not None:
            aside.rename(each.data_dir)
    with contextlib.suppress(RestoreFailed, OSError, subprocess.SubprocessError):
        forget(cluster)


def _log_since(path: Path, offset: int) -> str:
    with path.open("rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")


def _where_replay_stopped(path: Path, offset: int) -> str:
    found = [match.group(1) for match in _REPLAY_END.finditer(_log_since(path, offset))]
    return "; ".join(found) if found else "(the server log does not say)"


def _trouble(path: Path, offset: int, lines: int = 25) -> str:
    """The lines of the member's log since the restore began that say what went wrong, and the last
    segment replay read from the archive (a missing or damaged one is the next: PostgreSQL does not
    log a segment restore_command did not find)."""
    text = _log_since(path, offset) if path.exists() else ""
    picked = [line for line in text.splitlines() if _TROUBLE.search(line)]
    said = "\n".join(picked[-lines:]) or "\n".join(text.splitlines()[-lines:]) or "(nothing)"
    restored = _RESTORED.findall(text)
    if restored:
        said += f"\nthe last WAL segment replay read from the archive: {restored[-1]}"
    return said
