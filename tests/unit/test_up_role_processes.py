"""`chimes up` hands its settings to its scheduler and worker processes through their CHIMES_*
variables (chimes.cli.role_processes): what each child's own command line then reads."""

from __future__ import annotations

from typing import Any

import click
import pytest

from chimes.cli.main import cli
from chimes.cli.role_processes import describe_exit, role_commands

DSN = "postgresql://chimes:s3cret@127.0.0.1:5432/chimes"


def _children(*up_args: str) -> dict[str, dict[str, str]]:
    root = cli.make_context("chimes", ["--log-level", "DEBUG", "up", *up_args], resilient_parsing=True)
    up = cli.commands["up"]
    up_context = up.make_context("up", list(up_args), parent=root)
    return {command.role: dict(command.env) for command in role_commands(root, up_context.params, DSN)}


def _parsed(role: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The options ``chimes ROLE`` reads, with no arguments, from ``env`` alone."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    root = cli.make_context("chimes", [role], resilient_parsing=True)
    return root.params | cli.commands[role].make_context(role, [], parent=root).params


def test_the_worker_gets_ups_concurrency_egress_commands_and_key(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CHIMES_EGRESS_ALLOW", "CHIMES_ALLOW_COMMANDS", "CHIMES_EGRESS_ALLOW_LOOPBACK",
                 "CHIMES_WORKER_CONCURRENCY", "CHIMES_SECRET_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    children = _children("--worker-concurrency", "7", "--egress-deny-loopback", "--egress-allow", "10.0.0.0/8",
                         "--egress-allow", "api.example.com", "--secret-key-file", "/keys/chimes.key",
                         "--data-dir", "/srv/chimes")
    assert set(children) == {"scheduler", "worker"}
    worker = _parsed("worker", children["worker"], monkeypatch)
    assert worker["concurrency"] == 7
    assert worker["allow_commands"] is True  # up's default, not the worker command's
    assert worker["egress_allow_loopback"] is False
    assert [e for v in worker["egress_allow"] for e in v.split(",")] == ["10.0.0.0/8", "api.example.com"]
    assert str(worker["secret_key_file"]) == "/keys/chimes.key" and str(worker["data_dir"]) == "/srv/chimes"
    assert worker["database_url"] == DSN and worker["log_level"] == "DEBUG"


def test_the_scheduler_gets_ups_egress_and_nothing_of_the_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHIMES_EGRESS_ALLOW_LOOPBACK", raising=False)
    env = _children("--write-rate", "10")["scheduler"]
    assert "CHIMES_WRITE_RATE" not in env and "CHIMES_WORKER_CONCURRENCY" not in env
    scheduler = _parsed("scheduler", env, monkeypatch)
    assert scheduler["egress_allow_loopback"] is True  # up's default: the README's tour calls 127.0.0.1


def test_the_database_url_goes_in_the_environment_where_ps_does_not_show_it() -> None:
    # A child's command line is `python -m chimes ROLE`: the URL, with its password, only in its variables.
    for env in _children().values():
        assert env["CHIMES_DATABASE_URL"] == DSN


@pytest.mark.parametrize(("status", "said"), [(3, "exited with status 3"), (-9, "was killed by SIGKILL"),
                                              (0, "exited with status 0")])
def test_how_a_childs_end_is_described(status: int, said: str) -> None:
    assert describe_exit(status) == said


def test_up_still_has_every_flag_it_had() -> None:
    names = {p.name for p in cli.commands["up"].params if isinstance(p, click.Option)}
    assert {"database_url", "data_dir", "host", "port", "worker_concurrency", "allow_commands",
            "egress_allow_loopback", "secret_key_file", "processes"} <= names


@pytest.mark.parametrize(("args", "variable", "processes"), [
    ([], None, False),                                 # the default: every role in the one process
    (["--processes"], None, True),
    (["--single-process"], None, False),
    ([], "true", True),                                # CHIMES_UP_PROCESSES=true
    (["--single-process"], "true", False),             # the command line wins over the variable
])
def test_up_runs_its_roles_in_one_process_unless_told_processes(
    args: list[str], variable: str | None, processes: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if variable is None:
        monkeypatch.delenv("CHIMES_UP_PROCESSES", raising=False)
    else:
        monkeypatch.setenv("CHIMES_UP_PROCESSES", variable)
    root = cli.make_context("chimes", ["up", *args], resilient_parsing=True)
    assert cli.commands["up"].make_context("up", args, parent=root).params["processes"] is processes


def test_worker_processes_share_ups_concurrency_out_among_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHIMES_WORKER_CONCURRENCY", raising=False)
    root = cli.make_context("chimes", ["up"], resilient_parsing=True)
    up_context = cli.commands["up"].make_context("up", ["--worker-concurrency", "101", "--processes",
                                                        "--worker-processes", "3"], parent=root)
    commands = role_commands(root, up_context.params, DSN, up_context.params["worker_processes"])
    assert [c.label for c in commands] == ["scheduler", "worker 1", "worker 2", "worker 3"]
    shares = [_parsed("worker", dict(c.env), monkeypatch)["concurrency"] for c in commands[1:]]
    assert shares == [34, 34, 33]  # still 101 runs at once in all


@pytest.mark.parametrize(("args", "says"), [
    (["--worker-processes", "2"], "add --processes"),
    (["--processes", "--worker-processes", "4", "--worker-concurrency", "3"], "at least 4"),
])
def test_worker_processes_refused_before_anything_starts(args: list[str], says: str) -> None:
    from click.testing import CliRunner

    result = CliRunner().invoke(cli, ["up", "--database-url", DSN, *args])
    assert result.exit_code == 2
    assert "--worker-processes" in result.output and says in result.output
