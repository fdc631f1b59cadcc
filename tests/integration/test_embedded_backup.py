"""WAL archiving of the embedded server, and restores that cannot be done: each is refused with what to
do, and leaves nothing behind (tests/e2e/test_backup_restore.py is the drill that succeeds)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest
from click.testing import CliRunner

from chimes.cli.main import cli
from chimes.store.backup import BackupError, BaseBackup, base_backups, restore
from chimes.store.embedded import Archiving, EmbeddedPostgres

pytestmark = pytest.mark.long  # backups and restores of a real data dir


def sql(dsn: str, statement: str) -> list[asyncpg.Record]:
    async def run() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(dsn)
        try:
            return await conn.fetch(statement)
        finally:
            await conn.close()

    return asyncio.run(run())


def take_backup(data_dir: Path, backups: Path, *options: str) -> list[BaseBackup]:
    """`chimes backup` as an operator runs it, beside the process that uses the server."""
    took = subprocess.run([sys.executable, "-m", "chimes", "backup", "--data-dir", str(data_dir),
                           "--backup-dir", str(backups), *options], capture_output=True, text=True, timeout=300,
                          check=False)
    assert took.returncode == 0, took.stderr
    return base_backups(backups)


def wal_files(backups: Path) -> list[str]:
    return sorted(path.name for path in (backups / "wal").iterdir())


@pytest.fixture
def folder() -> Iterator[Path]:
    """Outside pytest's tmp_path: another pytest session on the machine may clean that up under a
    running server (see chimes.store.embedded.server_for_a_while)."""
    made = Path(tempfile.mkdtemp(prefix="chimes-test-backup-"))
    yield made
    shutil.rmtree(made, ignore_errors=True)


@pytest.mark.single_database("an embedded server of its own")
def test_archiving_a_backup_and_the_restores_that_are_refused(folder: Path) -> None:
    data_dir, backups = folder / "data", folder / "backups"
    server = EmbeddedPostgres(data_dir)
    dsn = server.acquire()
    try:
        sql(dsn, "CREATE TABLE kept (n int)")
        sql(dsn, "INSERT INTO kept VALUES (1)")
        assert sql(dsn, "SHOW archive_mode")[0][0] == "off"
        server.acquire(Archiving(backups))  # the only user: the server restarts with archiving on
        assert sql(dsn, "SHOW archive_mode")[0][0] == "on"

        other = subprocess.Popen([sys.executable, "-c", "input()"], stdin=subprocess.PIPE)  # another live user
        try:
            (data_dir / "postgres-users.json").write_text(json.dumps([os.getpid(), other.pid]))
            with pytest.raises(RuntimeError, match="other processes use"):
                server.acquire(Archiving(None))
            assert sql(dsn, "SHOW archive_mode")[0][0] == "on", "a refused change changed the server"
        finally:
            other.communicate(b"\n", timeout=30)

        [first] = take_backup(data_dir, backups)
        sql(dsn, "INSERT INTO kept VALUES (2)")
        sql(dsn, "SELECT pg_switch_wal()")
        wal_before = wal_files(backups)
        [made] = take_backup(data_dir, backups, "--keep", "1")  # the first one goes, and the WAL only it needed
        assert made.folder != first.folder and not first.folder.exists()
        assert wal_files(backups)[0] > wal_before[0], "no WAL older than the kept backup was removed"
    finally:
        server.release()
    assert not server.is_running()

    target = folder / "restored"
    with pytest.raises(BackupError, match="no backup restores to that time"):
        restore(backups, target, made.started - timedelta(hours=1))
    with pytest.raises(BackupError, match="recovery ended before configured recovery target was reached"):
        restore(backups, target, datetime.now(UTC) + timedelta(hours=1))
    assert sorted(path.name for path in folder.iterdir()) == ["backups", "data"], "a failed restore left files"

    done = restore(backups, target)  # the latest: the clean stop archived the last insert
    assert done.replaced is None and done.backup.folder == made.folder
    again = EmbeddedPostgres(target)
    dsn = again.acquire()
    try:
        assert [row[0] for row in sql(dsn, "SELECT n FROM kept ORDER BY n")] == [1, 2]
        assert sql(dsn, "SHOW archive_mode")[0][0] == "off", "a restored server archives only when told where"
    finally:
        again.release()


def test_bad_restore_and_backup_options_are_refused_by_name(tmp_path: Path) -> None:
    runner = CliRunner()
    naive = runner.invoke(cli, ["restore", "--from", str(tmp_path), "--to-time", "2026-12-04T05:00:00",
                                "--data-dir", str(tmp_path / "d")])
    assert naive.exit_code == 2 and "--to-time" in naive.output and "no time zone" in naive.output
    empty = runner.invoke(cli, ["restore", "--from", str(tmp_path), "--data-dir", str(tmp_path / "d")])
    assert empty.exit_code == 1 and "no base backup" in empty.output
    external = runner.invoke(cli, ["up", "--database-url", "postgresql://x@127.0.0.1/x", "--backup-dir",
                                   str(tmp_path / "b")])
    assert external.exit_code == 2 and "--backup-dir" in external.output and "pgBackRest" in external.output
    unsafe = runner.invoke(cli, ["up", "--data-dir", str(tmp_path / "d"), "--backup-dir", str(tmp_path / "it's")])
    assert unsafe.exit_code == 2 and "may not contain" in unsafe.output
    assert sorted(path.name for path in tmp_path.iterdir()) == [], "a refused command made files"


# --- restores that would finish short ----------------------------------------------------------------
# A base backup, then five rows, each committed in a WAL segment of its own: row n is in the n-th
# segment archived after the backup's. A restore without --to-time must reach the archive's end or say
# which file stopped it; nothing it refuses touches the data dir.

ROWS = 5


@dataclass(frozen=True)
class Archive:
    backups: Path
    before: list[datetime]  # before[n]: after row n-1 committed and before row n began (n from 1)

    def segment_of_row(self, n: int) -> Path:
        [backup] = base_backups(self.backups)
        start = re.search(r"\(file ([0-9A-F]{24})\)", (backup.folder / "postgres" / "backup_label").read_text())
        assert start is not None
        name = start.group(1)
        return self.backups / "wal" / f"{name[:16]}{int(name[16:], 16) + n:08X}"


@pytest.fixture(scope="module")
def archive() -> Iterator[Archive]:
    made = Path(tempfile.mkdtemp(prefix="chimes-test-archive-"))
    data_dir, backups = made / "data", made / "backups"
    server = EmbeddedPostgres(data_dir)
    dsn = server.acquire(Archiving(backups))
    before = [datetime.now(UTC)]
    try:
        sql(dsn, "CREATE TABLE kept (n int)")
        sql(dsn, "INSERT INTO kept VALUES (0)")
        take_backup(data_dir, backups)
        for n in range(1, ROWS + 1):
            before.append(datetime.now(UTC))
            sql(dsn, f"INSERT INTO kept VALUES ({n})")
            sql(dsn, "SELECT pg_switch_wal()")
    finally:
        server.release()
    yield Archive(backups, before)
    shutil.rmtree(made, ignore_errors=True)


@pytest.fixture
def copy_of(archive: Archive, folder: Path) -> Archive:
    """The archive, copied with its owners and modes (as a restore drill would use it)."""
    subprocess.run(["cp", "-a", str(archive.backups), str(folder / "backups")], check=True)
    return Archive(folder / "backups", archive.before)


def restored_rows(data_dir: Path) -> list[int]:
    server = EmbeddedPostgres(data_dir)
    dsn = server.acquire()
    try:
        return [row[0] for row in sql(dsn, "SELECT n FROM kept ORDER BY n")]
    finally:
        server.release()


def chimes_restore(backups: Path, data_dir: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "chimes", "restore", "--from", str(backups), "--data-dir",
                           str(data_dir), *options], capture_output=True, text=True, timeout=300, check=False)


def left_behind(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if path.name != "backups")


@pytest.mark.single_database("an embedded server of its own")
def test_a_whole_archive_restores_every_row(copy_of: Archive, folder: Path) -> None:
    done = restore(copy_of.backups, folder / "restored")
    assert "the archived WAL to its end" in done.reached, done.reached
    assert restored_rows(folder / "restored") == list(range(ROWS + 1))


@pytest.mark.single_database("an embedded server of its own")
def test_a_missing_segment_fails_the_restore_naming_it_unless_the_time_asked_for_is_before_it(
    copy_of: Archive, folder: Path
) -> None:
    gap = copy_of.segment_of_row(3)
    gap.unlink()
    refused = chimes_restore(copy_of.backups, folder / "restored")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert f"the archived WAL has a gap: {gap} is missing" in refused.stderr, refused.stderr
    assert "nothing was restored" in refused.stderr
    assert left_behind(folder) == [], "a refused restore left files"

    # Asked for a time before the gap (before a commit replay reaches, which shows the point was passed):
    # restored, with the rows of then.
    before_gap = restore(copy_of.backups, folder / "restored", copy_of.before[2])
    assert "recovery stopping before commit" in before_gap.reached, before_gap.reached
    assert restored_rows(folder / "restored") == [0, 1]

    # Asked for a time after it: the gap is named, not "the archive ends before --to-time".
    with pytest.raises(BackupError, match=f"replay stopped before --to-time .*gap: {gap} is missing"):
        restore(copy_of.backups, folder / "later", datetime.now(UTC))


@pytest.mark.single_database("an embedded server of its own")
def test_a_corrupt_segment_fails_the_restore_naming_it(copy_of: Archive, folder: Path) -> None:
    corrupt = copy_of.segment_of_row(2)
    with corrupt.open("r+b") as segment:
        segment.seek(64)  # in the first record after the page header
        segment.write(b"\xff" * 512)
    with pytest.raises(BackupError, match=f"{corrupt} is corrupt .*checksum") as refused:
        restore(copy_of.backups, folder / "restored")
    assert "nothing was restored" in str(refused.value)
    assert left_behind(folder) == [], "a refused restore left files"


@pytest.mark.single_database("an embedded server of its own")
def test_a_backup_the_server_cannot_read_is_refused_as_such(archive: Archive, folder: Path) -> None:
    """The archive copied back as root (owned by root, mode 0600), or a file without read permission."""
    backups = folder / "backups"
    if os.geteuid() == 0:
        shutil.copytree(archive.backups, backups)
    else:
        subprocess.run(["cp", "-a", str(archive.backups), str(backups)], check=True)
        Archive(backups, []).segment_of_row(1).chmod(0)
    for to_time in (None, datetime.now(UTC)):
        with pytest.raises(BackupError, match="permission denied: .* cannot read .*the first "
                                              f"{Archive(backups, []).segment_of_row(0 if os.geteuid() == 0 else 1)}"
                           ) as refused:
            restore(backups, folder / "restored", to_time)
        assert "ends before --to-time" not in str(refused.value)
        assert left_behind(folder) == [], "a refused restore left files"


@pytest.mark.single_database("an embedded server of its own")
def test_a_damaged_base_backup_is_refused_naming_the_file(copy_of: Archive, folder: Path) -> None:
    [backup] = base_backups(copy_of.backups)
    catalog = sorted((backup.folder / "postgres" / "base").glob("*/1259"))[0]  # pg_class of a database
    with catalog.open("r+b") as table:
        table.seek(0)
        table.write(os.urandom(512))
    refused = chimes_restore(copy_of.backups, folder / "restored")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    named = str(catalog.relative_to(backup.folder / "postgres"))
    assert "is damaged, nothing was restored" in refused.stderr and f'"{named}"' in refused.stderr, refused.stderr
    assert left_behind(folder) == [], "a refused restore left files"
