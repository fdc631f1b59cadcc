"""WAL archiving of the embedded server, and restores that cannot be done: each is refused with what to
do, and leaves nothing behind (tests/e2e/test_backup_restore.py is the drill that succeeds)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest
from click.testing import CliRunner

from chimes.cli.main import cli
from chimes.store.backup import BackupError, BaseBackup, base_backups, restore
from chimes.store.embedded import Archiving, EmbeddedPostgres


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
