"""The Patroni cluster's backups on PostgreSQL's own tools: the archive and restore commands every
member gets, Patroni's custom bootstrap while ``chimes ha restore`` runs, the retention decisions, the
bootstrap script, and the refusals of ``chimes ha backup`` and ``chimes ha restore``.

The restore itself runs end to end in tests/e2e/test_ha_restore.py; verification against real base
backups in tests/integration/test_ha_base_backups.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from click.testing import CliRunner

from chimes.cli.main import cli
from chimes.ha import restore_bootstrap
from chimes.ha.cluster import RESTORE_METHOD, RESTORE_SCRIPT, BackupTool, HaCluster, RestorePlan
from chimes.ha.repository import BaseBackup, Repository, plan_retention, restore_command
from chimes.ha.restore import RestoreFailed, check_archive_reaches, choose_backup, restore_cluster

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def test_every_member_archives_always_into_a_folder_of_its_own(tmp_path: Path) -> None:
    cluster = HaCluster(tmp_path / "ha", postgres=3, backup_repo=tmp_path / "repo")
    assert cluster.repository is not None and cluster.pgbackrest is None
    wal = (tmp_path / "repo" / "wal").resolve()
    folders = set()
    for member in cluster.postgres:
        postgresql = cluster.patroni_config(member)["postgresql"]
        parameters = postgresql["parameters"]
        # always: a standby archives what it receives, so a lost primary's unarchived segments are not lost.
        assert parameters["archive_mode"] == "always"
        assert parameters["archive_timeout"] == 60
        own = f"{wal / member.name}/%f"
        assert own in parameters["archive_command"]
        assert all(f"{wal / other.name}/" not in parameters["archive_command"]
                   for other in cluster.postgres if other is not member)
        folders.add(own)
        assert postgresql["recovery_conf"]["restore_command"] == restore_command(wal.parent, member.name)
        assert "method" not in cluster.patroni_config(member)["bootstrap"]
    assert len(folders) == 3


def test_a_cluster_written_before_backup_tools_keeps_pgbackrest(tmp_path: Path) -> None:
    HaCluster(tmp_path / "ha", postgres=2)
    state = json.loads((tmp_path / "ha" / "ha.json").read_text())
    state.pop("backup_tool")
    state["backup_repo"] = str(tmp_path / "repo")  # as chimes ha up --backup-repo wrote it when it meant pgBackRest
    (tmp_path / "ha" / "ha.json").write_text(json.dumps(state))
    again = HaCluster(tmp_path / "ha")
    assert again.pgbackrest is not None and again.repository is None
    switched = HaCluster(tmp_path / "ha", backup_tool=BackupTool.POSTGRES)
    assert switched.repository is not None and HaCluster(tmp_path / "ha").repository is not None


def run_restore_command(repo: Path, member: str, name: str, into: Path) -> int:
    """The restore command as PostgreSQL runs it: %f and %p replaced, through the shell."""
    command = restore_command(repo, member).replace("%f", name).replace("%p", str(into))
    return subprocess.run(["sh", "-c", command], check=False).returncode


def test_the_restore_command_reads_the_members_own_copy_first_then_any_other(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for member, files in {"pg1": {"A": "pg1's A"}, "pg2": {"B": "pg2's B"}, "pg3": {"A": "pg3's A"}}.items():
        (repo / "wal" / member).mkdir(parents=True)
        for name, text in files.items():
            (repo / "wal" / member / name).write_text(text)
    into = tmp_path / "pg_wal" / "RECOVERYXLOG"
    into.parent.mkdir()
    assert run_restore_command(repo, "pg1", "A", into) == 0 and into.read_text() == "pg1's A"
    assert run_restore_command(repo, "pg3", "A", into) == 0 and into.read_text() == "pg3's A"
    assert run_restore_command(repo, "pg2", "A", into) == 0 and into.read_text() in ("pg1's A", "pg3's A")
    assert run_restore_command(repo, "pg1", "B", into) == 0 and into.read_text() == "pg2's B"
    into.unlink()
    assert run_restore_command(repo, "pg1", "C", into) == 1 and not into.exists()


def test_while_restoring_patroni_bootstraps_by_the_restore_method(tmp_path: Path) -> None:
    cluster = HaCluster(tmp_path / "ha", postgres=2, backup_repo=tmp_path / "repo")
    cluster.python = "/usr/bin/python3"
    member = cluster.postgres[0]
    backup = tmp_path / "repo" / "base" / "20261204T040000Z" / "data"
    cluster.restoring = RestorePlan(backup, datetime(2026, 12, 4, 6, 0, tzinfo=timezone(timedelta(hours=1))))
    config = cluster.patroni_config(member)
    assert config["bootstrap"]["method"] == RESTORE_METHOD
    method = config["bootstrap"][RESTORE_METHOD]
    assert method["command"] == f"/usr/bin/python3 {member.dir / RESTORE_SCRIPT}"
    assert method["backup"] == str(backup)  # Patroni passes it on as --backup=
    assert method["recovery_conf"] == {
        "restore_command": restore_command((tmp_path / "repo").resolve(), member.name),
        "recovery_target_time": "2026-12-04T05:00:00+00:00",
        "recovery_target_timeline": "latest",
        "recovery_target_action": "promote",
    }
    # The segments replay reads are in the archive already: the restoring member archives its new timeline only.
    assert config["postgresql"]["parameters"]["archive_mode"] == "on"
    assert config["bootstrap"]["initdb"]  # kept, unused while a method is named

    cluster.restoring = None
    after = cluster.patroni_config(member)
    assert "method" not in after["bootstrap"] and RESTORE_METHOD not in after["bootstrap"]
    assert after["postgresql"]["parameters"]["archive_mode"] == "always"


def backup(hour: int, *, verified: bool = True) -> BaseBackup:
    started = T0 + timedelta(hours=hour)
    return BaseBackup(Path(f"/repo/base/{hour}"), started, started + timedelta(minutes=5), "pg2",
                      f"0000000100000000000000{hour:02X}", None if verified else "pg_verifybackup failed")


@pytest.mark.parametrize(("backups", "keep", "removed", "first_wal"), [
    ([backup(1), backup(2), backup(3)], 2, [1], "000000010000000000000002"),
    ([backup(3), backup(1), backup(2)], 1, [1, 2], "000000010000000000000003"),  # in any order
    ([backup(1), backup(2)], 2, [], "000000010000000000000001"),  # the WAL before the oldest restores nothing
    ([backup(1), backup(2)], 5, [], "000000010000000000000001"),
    # A failed backup is never one of the kept: older than the oldest kept it goes, newer it stays.
    ([backup(1, verified=False), backup(2), backup(3, verified=False), backup(4), backup(5, verified=False)], 1,
     [1, 2, 3], "000000010000000000000004"),
    ([backup(1), backup(2, verified=False), backup(3, verified=False)], 2, [], "000000010000000000000001"),
    ([backup(1, verified=False), backup(2, verified=False)], 1, [], None),  # nothing verified: nothing goes
    ([], 2, [], None),
])
def test_retention_keeps_the_newest_verified_backups_and_the_wal_they_need(
        backups: list[BaseBackup], keep: int, removed: list[int], first_wal: str | None) -> None:
    plan = plan_retention(backups, keep)
    assert sorted(int(b.folder.name) for b in plan.remove) == removed
    assert plan.first_wal_kept == first_wal


def test_retention_keeps_at_least_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        plan_retention([backup(1)], 0)


def write_backup(repo: Repository, hour: int, start_wal: str) -> Path:
    started = T0 + timedelta(hours=hour)
    folder = repo.base / started.strftime("%Y%m%dT%H%M%SZ")
    (folder / "data").mkdir(parents=True)
    (folder / "backup.json").write_text(json.dumps({"started": started.isoformat(), "finished": started.isoformat(),
                                                    "member": "pg1", "startWal": start_wal}))
    return folder


def test_pruning_removes_the_old_backups_and_the_wal_only_they_needed(tmp_path: Path) -> None:
    repo = Repository(tmp_path / "repo")
    first = write_backup(repo, 1, "000000010000000000000002")
    second = write_backup(repo, 2, "000000020000000000000005")
    third = write_backup(repo, 3, "000000030000000000000007")
    archived = {
        "pg1": ["000000010000000000000002", "000000010000000000000004.partial", "00000002.history",
                "000000020000000000000004", "000000020000000000000005", "000000020000000000000006"],
        "pg2": ["000000010000000000000003", "000000010000000000000003.00000028.backup", "000000020000000000000005",
                "00000003.history", "000000030000000000000007"],
    }
    for member, names in archived.items():
        (repo.wal / member).mkdir(parents=True, exist_ok=True)
        for name in names:
            (repo.wal / member / name).write_text(name)
    plan, removed = repo.prune(keep=2)
    assert [b.folder for b in plan.remove] == [first] and not first.exists() and second.exists() and third.exists()
    left = {member: sorted(path.name for path in (repo.wal / member).iterdir()) for member in archived}
    # Older than segment 5 goes, whatever its timeline; timeline history files stay (a restore follows them).
    assert left == {"pg1": ["00000002.history", "000000020000000000000005", "000000020000000000000006"],
                    "pg2": ["000000020000000000000005", "00000003.history", "000000030000000000000007"]}
    assert removed == 5


def test_the_bootstrap_script_copies_the_backup_without_what_must_not_come_along(tmp_path: Path) -> None:
    source = tmp_path / "base" / "data"
    for name in ("PG_VERSION", "backup_label", "postgresql.conf", "base/5/1259", "pg_wal/000000010000000000000002",
                 "pg_wal/archive_status/x", *restore_bootstrap.LEFT_OUT, "base/5/backup_manifest"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text(name)
    target = tmp_path / "member" / "data"
    script = Path(restore_bootstrap.__file__)
    done = subprocess.run([sys.executable, str(script), "--scope=chimes", f"--datadir={target}", f"--backup={source}"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    copied = sorted(str(path.relative_to(target)) for path in target.rglob("*") if path.is_file())
    assert copied == ["PG_VERSION", "backup_label", "base/5/1259", "base/5/backup_manifest",
                      "pg_wal/000000010000000000000002", "pg_wal/archive_status/x", "postgresql.conf"]
    assert target.stat().st_mode & 0o777 == 0o700

    again = subprocess.run([sys.executable, str(script), f"--datadir={target}", f"--backup={source}"],
                           capture_output=True, text=True, check=False)
    assert again.returncode == 1 and "not empty" in again.stderr
    not_a_backup = subprocess.run([sys.executable, str(script), f"--datadir={tmp_path / 'other'}",
                                   f"--backup={tmp_path}"], capture_output=True, text=True, check=False)
    assert not_a_backup.returncode == 1 and "no base backup" in not_a_backup.stderr
    assert not (tmp_path / "other").exists()


def test_a_target_after_every_archived_segment_is_refused_at_once(tmp_path: Path) -> None:
    repo = Repository(tmp_path / "repo")
    (repo.wal / "pg1").mkdir(parents=True)
    with pytest.raises(RestoreFailed, match="holds no segment"):
        check_archive_reaches(repo, T0)
    segment = repo.wal / "pg1" / "000000010000000000000003"
    segment.write_text("")
    os.utime(segment, (T0.timestamp(), T0.timestamp()))
    history = repo.wal / "pg1" / "00000002.history"  # written later, but not WAL that replay reads
    history.write_text("")
    with pytest.raises(RestoreFailed, match="nothing archived reaches that time"):
        check_archive_reaches(repo, T0)
    check_archive_reaches(repo, T0 - timedelta(seconds=1))


def test_a_target_before_every_verified_backup_is_refused(tmp_path: Path) -> None:
    repo = Repository(tmp_path / "repo")
    with pytest.raises(RestoreFailed, match="there is none"):
        choose_backup(repo, T0, print)
    write_backup(repo, 2, "000000010000000000000002")
    with pytest.raises(RestoreFailed, match=r"finished by 2026-12-01T01:00:00\+00:00 \(the oldest was finished at "
                                            r"2026-12-01T02:00:00\+00:00\)"):
        choose_backup(repo, T0 + timedelta(hours=1), print)


def test_a_running_cluster_is_not_restored(tmp_path: Path) -> None:
    cluster = HaCluster(tmp_path / "ha", postgres=2, backup_repo=tmp_path / "repo")
    etcd = cluster.etcd[1]
    # A stand-in for etcd on the member's data dir: what restore looks for is the process, whoever started it.
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--data-dir", str(etcd.data_dir)])
    try:
        with pytest.raises(RestoreFailed, match=r"is running \(etcd2\): stop chimes ha up first"):
            restore_cluster(cluster, T0)
    finally:
        stand_in.kill()
        stand_in.wait()
    assert not any(path.name.startswith("data.before-restore") for member in cluster.postgres
                   for path in (member.dir.iterdir() if member.dir.exists() else []))


def test_the_commands_refuse_what_they_cannot_do(tmp_path: Path) -> None:
    runner = CliRunner()
    HaCluster(tmp_path / "ha", postgres=2, backup_repo=tmp_path / "repo")
    missing = runner.invoke(cli, ["ha", "restore", "--data-dir", str(tmp_path)])
    assert missing.exit_code == 2 and "--to-time" in missing.output
    naive = runner.invoke(cli, ["ha", "restore", "--data-dir", str(tmp_path), "--to-time", "2026-12-04T05:00:00"])
    assert naive.exit_code == 2 and "has no time zone" in naive.output
    diff = runner.invoke(cli, ["ha", "backup", "--data-dir", str(tmp_path), "--type", "diff"])
    assert diff.exit_code == 2 and "full base backups only" in diff.output

    HaCluster(tmp_path / "other" / "ha", postgres=2)
    no_repo = runner.invoke(cli, ["ha", "restore", "--data-dir", str(tmp_path / "other"), "--to-time",
                                  "2026-12-04T05:00:00Z"])
    assert no_repo.exit_code == 1 and "keeps no backups" in no_repo.output
    no_backup = runner.invoke(cli, ["ha", "backup", "--data-dir", str(tmp_path / "other")])
    assert no_backup.exit_code == 1 and "--backup-repo" in no_backup.output
    tool_only = runner.invoke(cli, ["ha", "up", "--data-dir", str(tmp_path / "other"), "--backup-tool", "postgres"])
    assert tool_only.exit_code == 2 and "give --backup-repo too" in tool_only.output

    HaCluster(tmp_path / "old" / "ha", postgres=2, backup_repo=tmp_path / "old-repo", backup_tool=BackupTool.PGBACKREST)
    keep = runner.invoke(cli, ["ha", "backup", "--data-dir", str(tmp_path / "old"), "--keep", "3"])
    assert keep.exit_code == 2 and "repo1-retention-full" in keep.output
