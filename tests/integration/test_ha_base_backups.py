"""Base backups of the HA cluster are verified before they count, and again before a restore uses
them: real ``pg_basebackup`` copies of a real server (an embedded one: its binaries are the cluster's),
one of them damaged as a disk would damage it."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from chimes.ha.base_backup import BackupFailed, begin, copy, finish
from chimes.ha.repository import BaseBackup, Repository, plan_retention
from chimes.ha.restore import RestoreFailed, choose_backup

T0 = datetime.now(UTC) - timedelta(hours=1)


@pytest.fixture
def repo() -> Iterator[Repository]:
    # Not under pytest's tmp_path (its folders are private to root): the PostgreSQL user writes here.
    top = Path(tempfile.mkdtemp(prefix="chimes-ha-repo-"))
    repository = Repository(top / "repo")
    repository.prepare(["pg1"])
    try:
        yield repository
    finally:
        shutil.rmtree(top, ignore_errors=True)


def backup_of(server_dsn: str, repo: Repository, minutes: int) -> BaseBackup:
    """A base backup of the server, as chimes ha backup takes one, begun ``minutes`` after T0."""
    url = urlsplit(server_dsn)
    socket_dir = parse_qs(url.query)["host"][0]
    partial = begin(repo)
    copy(partial, ["-h", socket_dir, "-U", url.username or "postgres"], unquote(url.password or ""))
    started = T0 + timedelta(minutes=minutes)
    return finish(repo, partial, started, started + timedelta(seconds=5), "pg1")


def damage(backup: BaseBackup) -> None:
    """512 bytes of a catalog file overwritten (a file the manifest lists, checksummed)."""
    catalog = next(path for path in sorted((backup.data / "base" / "1").iterdir()) if path.stat().st_size > 8192)
    with catalog.open("r+b") as file:
        file.seek(4096)
        file.write(b"\xff" * 512)


def test_a_backup_that_fails_verification_is_kept_apart_and_never_counted(second_server_dsn: str,
                                                                          repo: Repository) -> None:
    good = backup_of(second_server_dsn, repo, 0)
    assert good.verified and good.folder.name == good.started.strftime("%Y%m%dT%H%M%SZ")

    partial = begin(repo)
    url = urlsplit(second_server_dsn)
    copy(partial, ["-h", parse_qs(url.query)["host"][0], "-U", "postgres"], unquote(url.password or ""))
    damage(BaseBackup(partial, T0, T0, "pg1", ""))
    started = T0 + timedelta(minutes=10)
    with pytest.raises(BackupFailed, match="failed verification and does not count") as failed:
        finish(repo, partial, started, started, "pg1")
    assert "checksum mismatch" in str(failed.value)

    [kept, bad] = repo.backups()
    assert kept == good and bad.folder.name.endswith(".failed") and not bad.verified and not partial.exists()
    assert "checksum mismatch" in (bad.error or "")
    assert plan_retention(repo.backups(), 1).remove == ()  # the good one is the only one kept, and newest
    said: list[str] = []
    assert choose_backup(repo, datetime.now(UTC), said.append) == (good, [])


def test_a_restore_passes_over_a_backup_damaged_since(second_server_dsn: str, repo: Repository) -> None:
    older = backup_of(second_server_dsn, repo, 0)
    newer = backup_of(second_server_dsn, repo, 10)
    damage(newer)
    said: list[str] = []
    chosen, passed_over = choose_backup(repo, datetime.now(UTC), said.append)
    assert chosen == older and [backup for backup, _ in passed_over] == [newer]
    assert said and newer.name in said[0] and "fails verification" in said[0]

    damage(older)
    with pytest.raises(RestoreFailed, match=r"every base backup .* fails verification"):
        choose_backup(repo, datetime.now(UTC), said.append)
