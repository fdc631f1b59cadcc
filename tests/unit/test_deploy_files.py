"""The deployment files in deploy/ use only commands, flags and CHIMES_* variables that exist.

Each ``chimes`` command line of the systemd units (``ExecStart=``) and of the Kubernetes manifests
(``command`` + ``args``) is parsed and checked against the click command objects of the CLI: the
subcommand exists, every flag is one of its options (or of the group's, before the subcommand),
and every ``CHIMES_*`` variable the file sets is an option's variable of that command. The YAML
must parse, and the manifests hold what the deployment needs.
"""

from __future__ import annotations

import configparser
import shlex
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from chimes.cli.main import cli
from chimes.security.secrets import KEY_ENV

DEPLOY = Path(__file__).parents[2] / "deploy"
SYSTEMD = sorted((DEPLOY / "systemd").glob("*.service"))
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
ROLES = {"api", "scheduler", "worker", "migrate"}
#: Read by the processes themselves rather than through an option: the secret key (security/secrets.py).
PROCESS_VARIABLES = {KEY_ENV}


def flags_of(command: click.Command) -> set[str]:
    return {name for param in command.params if isinstance(param, click.Option)
            for name in (*param.opts, *param.secondary_opts)}


def envvars_of(command: click.Command) -> set[str]:
    names: set[str] = set()
    for param in command.params:
        if isinstance(param, click.Option) and param.envvar:
            names.update([param.envvar] if isinstance(param.envvar, str) else param.envvar)
    return names


def check_command_line(argv: list[str], env: set[str], where: str) -> str:
    """Check one ``chimes ...`` line; returns the subcommand's name."""
    assert Path(argv[0]).name == "chimes", f"{where}: not a chimes command: {argv}"
    group_flags = flags_of(cli)
    rest = argv[1:]
    while rest and rest[0].startswith("-"):
        flag = rest[0].split("=", 1)[0]
        assert flag in group_flags, f"{where}: chimes has no option {flag}"
        rest = rest[1:] if "=" in rest[0] else rest[2:]
    assert rest, f"{where}: no subcommand in {argv}"
    name, args = rest[0], rest[1:]
    assert isinstance(cli, click.Group)
    command = cli.commands.get(name)
    assert command is not None, f"{where}: chimes has no command {name!r}"
    known = flags_of(command)
    for arg in args:
        if arg.startswith("-"):
            assert arg.split("=", 1)[0] in known, f"{where}: chimes {name} has no option {arg}"
    # Every value must also be accepted: click parses the line as the real CLI would.
    context = command.make_context(name, list(args), resilient_parsing=False)
    context.close()
    unknown = {var for var in env if var.startswith("CHIMES_")} - envvars_of(command) - envvars_of(cli)
    unknown -= PROCESS_VARIABLES
    assert not unknown, f"{where}: chimes {name} reads no variable {sorted(unknown)}"
    return name


def unit_file(path: Path) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read_string(path.read_text().replace("\\\n", " "))  # systemd's line continuations
    return parser


def env_file_names(path: Path) -> set[str]:
    return {line.split("=", 1)[0] for line in path.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")}


def test_there_are_units_and_manifests_for_every_role() -> None:
    assert {path.stem.removeprefix("chimes-") for path in SYSTEMD} == ROLES
    assert len(MANIFESTS) >= 5


@pytest.mark.parametrize("path", SYSTEMD, ids=lambda p: p.name)
def test_systemd_units_run_existing_commands_and_flags(path: Path) -> None:
    unit = unit_file(path)
    service = unit["Service"]
    env = env_file_names(DEPLOY / "systemd" / "chimes.env")
    env |= {assignment.split("=", 1)[0] for assignment in shlex.split(service.get("Environment", ""))}
    name = check_command_line(shlex.split(service["ExecStart"]), env, path.name)
    assert name == path.stem.removeprefix("chimes-")
    assert service.get("Type") == ("oneshot" if name == "migrate" else "exec")
    assert service["EnvironmentFile"] == "/etc/chimes/chimes.env"
    if name != "migrate":
        assert "chimes-migrate.service" in unit["Unit"]["Requires"]


def containers(document: dict[str, Any]) -> list[dict[str, Any]]:
    spec = document.get("spec", {})
    template = spec.get("template") or spec.get("jobTemplate", {}).get("spec", {}).get("template") or {}
    return list(template.get("spec", {}).get("containers", []))


def all_documents() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_manifests_parse_and_run_existing_commands_and_flags() -> None:
    documents = all_documents()
    kinds: dict[str, list[dict[str, Any]]] = {}
    for path, document in documents:
        assert {"apiVersion", "kind"} <= document.keys(), path.name
        assert document["kind"] == "Kustomization" or "name" in document["metadata"], path.name
        kinds.setdefault(document["kind"], []).append(document)
        for container in containers(document):
            env = {item["name"] for item in container.get("env", [])}
            argv = [*container["command"], *container.get("args", [])]
            check_command_line(argv, env, f"{path.name}: {container['name']}")
    roles = {container["args"][container["args"].index(role)] for deployment in kinds["Deployment"]
             for container in containers(deployment) for role in ROLES if role in container["args"]}
    assert roles == {"api", "scheduler", "worker"}
    [job] = kinds["Job"]
    assert "migrate" in containers(job)[0]["args"]
    [service] = kinds["Service"]
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "api"


def test_workers_scale_on_queue_lag() -> None:
    [scaler] = [doc for _, doc in all_documents() if doc["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")]
    assert scaler["spec"]["scaleTargetRef"]["name"] == "chimes-worker"
    [trigger] = scaler["spec"]["triggers"]
    assert "chimes_queue_oldest_seconds" in trigger["metadata"]["query"]
    # The metric exists under that name.
    from chimes import metrics

    assert "chimes_queue_oldest_seconds" in Path(metrics.__file__).read_text()


def test_kustomization_lists_every_manifest_but_the_example_secret() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kubernetes" / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    others = {p.name for p in MANIFESTS} - {"kustomization.yaml", "secret.example.yaml"}
    assert listed == others
