"""pgBackRest for the Patroni cluster: the configuration `chimes ha up --backup-repo DIR --backup-tool
pgbackrest` generates, and the deployment files in deploy/pgbackrest, read by the real pgBackRest
(`pgbackrest info` warns about any option it does not know) and checked against each other.

A backup and restore with pgBackRest itself is a manual drill (docs/high-availability.md): Debian's
pgBackRest (2.45) does not support the embedded PostgreSQL 18. The backups on PostgreSQL's own tools,
the default, are tested in test_ha_repository.py and tests/e2e/test_ha_restore.py.
"""

from __future__ import annotations

import configparser
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from chimes.cli.main import cli
from chimes.cron import validate_cron
from chimes.ha.cluster import BackupTool, HaCluster
from chimes.ha.pgbackrest import STANZA, archive_command, restore_command

DEPLOY = Path(__file__).parents[2] / "deploy" / "pgbackrest"


def pgbackrest() -> str:
    found = shutil.which("pgbackrest")
    assert found, "pgBackRest is not installed: apt-get install pgbackrest (scripts/test does)"
    return found


def read_conf(text: str) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False)  # tls-server-auth repeats
    parser.read_string(text)
    return parser


def test_the_cluster_archives_into_the_repository_it_was_given(tmp_path: Path) -> None:
    cluster = HaCluster(tmp_path / "ha", postgres=2, backup_repo=tmp_path / "repo", backup_tool=BackupTool.PGBACKREST)
    assert cluster.pgbackrest is not None and cluster.repository is None
    config = cluster.pgbackrest.config
    for member in cluster.postgres:
        postgresql = cluster.patroni_config(member)["postgresql"]
        assert postgresql["parameters"]["archive_mode"] == "on"
        assert postgresql["parameters"]["archive_command"] == archive_command(config)
        assert postgresql["parameters"]["archive_timeout"] == 60
        assert postgresql["recovery_conf"]["restore_command"] == restore_command(config)
        assert f"--stanza={STANZA} archive-push \"%p\"" in archive_command(config)

    cluster.pgbackrest.write_config(cluster.backup_members())
    conf = read_conf(config.read_text())
    assert conf["global"]["repo1-path"] == str((tmp_path / "repo").resolve())
    assert conf["global"]["repo1-retention-full"] == "2"
    stanza = conf[STANZA]
    assert stanza["backup-standby"] == "y"
    for number, member in enumerate(cluster.postgres, start=1):
        assert stanza[f"pg{number}-path"] == str(member.data_dir)
        assert stanza[f"pg{number}-port"] == str(member.layout.client_port)
        assert stanza[f"pg{number}-socket-path"] == str(member.dir / "run")

    done = subprocess.run([pgbackrest(), f"--config={config}", f"--stanza={STANZA}", "info"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and "WARN" not in done.stdout + done.stderr, done.stdout + done.stderr
    info = cluster.pgbackrest.run(["info"], password="")  # as the PostgreSQL user, with its log and lock folders
    assert f"stanza: {STANZA}" in info and "missing stanza path" in info

    # ha.json keeps the repository and the tool: later starts of the folder go on archiving.
    again = HaCluster(tmp_path / "ha")
    assert again.pgbackrest is not None and again.pgbackrest.repo == (tmp_path / "repo").resolve()


def test_without_a_repository_nothing_is_archived(tmp_path: Path) -> None:
    cluster = HaCluster(tmp_path / "ha", postgres=2)
    assert cluster.pgbackrest is None and cluster.repository is None
    parameters = cluster.patroni_config(cluster.postgres[0])["postgresql"]["parameters"]
    assert "archive_command" not in parameters and "archive_mode" not in parameters
    refused = CliRunner().invoke(cli, ["ha", "backup", "--data-dir", str(tmp_path)])
    assert refused.exit_code == 1 and "--backup-repo" in refused.output


@pytest.mark.parametrize("name", ["repository-host.conf", "postgres-host.conf"])
def test_deploy_configurations_hold_only_options_pgbackrest_knows(name: str, tmp_path: Path) -> None:
    path = DEPLOY / name
    conf = read_conf(path.read_text())
    assert conf[STANZA]["pg1-path"].startswith("/var/lib/postgresql/")
    # info reads the whole file and warns about every option it does not know; the repository goes to
    # an empty folder here, and a TLS connection fails at once on the missing certificates.
    done = subprocess.run([pgbackrest(), f"--config={path}", f"--stanza={STANZA}", "--io-timeout=1",
                           f"--log-path={tmp_path}", f"--lock-path={tmp_path}",
                           *([f"--repo1-path={tmp_path}"] if name == "repository-host.conf" else []), "info"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "WARN" not in done.stdout + done.stderr and "ERROR" not in done.stderr, done.stdout + done.stderr


def test_patroni_snippet_archives_as_the_generated_configuration_does() -> None:
    snippet = yaml.safe_load((DEPLOY / "patroni-archiving.yml").read_text())["postgresql"]
    generic = Path("/etc/pgbackrest/pgbackrest.conf")  # pgBackRest's default: no --config needed
    assert snippet["parameters"]["archive_command"] == archive_command(generic).replace(f" --config={generic}", "")
    assert snippet["recovery_conf"]["restore_command"] == restore_command(generic).replace(f" --config={generic}", "")
    assert snippet["parameters"]["archive_mode"] == "on"
    assert snippet["create_replica_methods"][0] == "pgbackrest"


def backup_command(argv: list[str]) -> str:
    assert Path(argv[0]).name == "pgbackrest", argv
    assert f"--stanza={STANZA}" in argv and "backup" in argv, argv
    [kind] = [arg.removeprefix("--type=") for arg in argv if arg.startswith("--type=")]
    assert kind in ("full", "diff", "incr")
    return kind


def test_the_schedules_take_a_weekly_full_and_daily_incremental_backups() -> None:
    kinds = set()
    for timer in sorted(DEPLOY.glob("*.timer")):
        unit = read_conf(timer.read_text())
        service = read_conf((DEPLOY / timer.with_suffix(".service").name).read_text())
        kinds.add(backup_command(shlex.split(service["Service"]["ExecStart"])))
        assert service["Service"]["Type"] == "oneshot"
        assert unit["Timer"]["OnCalendar"] and unit["Timer"]["Persistent"] == "true"
    assert kinds == {"full", "incr"}

    jobs = [doc for doc in yaml.safe_load_all((DEPLOY / "cronjob.yaml").read_text()) if doc]
    scheduled = {}
    for job in jobs:
        assert job["kind"] == "CronJob" and job["spec"]["concurrencyPolicy"] == "Forbid"
        validate_cron(job["spec"]["schedule"])
        [container] = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
        scheduled[backup_command([*container["command"], *container["args"]])] = job["spec"]["schedule"]
    assert scheduled == {"full": "0 1 * * 0", "incr": "0 1 * * 1-6"}
