"""A stand-in for the docker CLI, for tests: no container engine runs on this machine.

:data:`FAKE_RUNTIME` is a small Python program that takes ``run --rm --name N --env-file F --env K=V IMAGE CMD...``
and runs ``CMD`` as a local process with only those variables (in its own session, as a container
lives outside the CLI's process group, its output relayed by the CLI), and answers ``stop -t T N``
and ``kill N`` by signalling the process it started for ``N``. It records every invocation and every
"container" it started, so tests can check the argv the worker sends and that nothing is left
running. Its failures print what docker prints. A ``stop-refuses`` file in its state folder makes
``stop`` fail, as a daemon that cannot stop a container does.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helpers import wait_for

DEADLINE_SEC = 15.0

FAKE_RUNTIME = '''#!{python}
"""Stand-in for a docker-compatible CLI (tests only): a "container" is a local process."""
import json, os, signal, subprocess, sys, time
from pathlib import Path

STATE = Path({state!r})


def append(name, entry):
    with open(STATE / name, "a") as fh:
        fh.write(json.dumps(entry) + "\\n")


def alive(pid):
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{{pid}}/stat").read_text()
    except (ProcessLookupError, FileNotFoundError):
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def run(args):
    env, name = {{"PATH": os.environ["PATH"]}}, None
    while args and args[0].startswith("-"):
        flag = args.pop(0)
        if flag == "--name":
            name = args.pop(0)
        elif flag == "--env":
            key, _, value = args.pop(0).partition("=")
            env[key] = value
        elif flag == "--env-file":  # KEY=VALUE lines, as docker reads them
            path = args.pop(0)
            append("env_files.jsonl", {{"path": path, "mode": oct(os.stat(path).st_mode & 0o777),
                                        "folder_mode": oct(os.stat(os.path.dirname(path)).st_mode & 0o777)}})
            for line in Path(path).read_text().splitlines():
                key, _, value = line.partition("=")
                env.setdefault(key, value)  # --env wins, whatever the order
        elif flag != "--rm":
            print(f"unknown flag: {{flag}}", file=sys.stderr)
            return 125
    image, command = args[0], args[1:] or ["echo", f"default command of {{args[0]}}"]
    if image == "no-such-image":
        print(f"Unable to find image '{{image}}:latest' locally", file=sys.stderr)
        print(f"docker: Error response from daemon: pull access denied for {{image}}", file=sys.stderr)
        print("\\nRun 'docker run --help' for more information", file=sys.stderr)
        return 125
    try:
        child = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        print(f'docker: exec: "{{command[0]}}": executable file not found in $PATH', file=sys.stderr)
        return 127
    (STATE / f"{{name}}.pid").write_text(str(child.pid))
    append("containers.jsonl", {{"name": name, "image": image, "pid": child.pid, "cli_pid": os.getpid()}})
    while chunk := os.read(child.stdout.fileno(), 65536):  # output reaches the CLI the way docker relays it
        os.write(1, chunk)
    code = child.wait()
    (STATE / f"{{name}}.pid").unlink()
    return code if code >= 0 else 128 - code


def signal_container(name, sig):
    try:
        pid = int((STATE / f"{{name}}.pid").read_text())
    except FileNotFoundError:
        print(f"Error response from daemon: No such container: {{name}}", file=sys.stderr)
        return None
    os.killpg(pid, sig)
    return pid


def stop(args):
    if (STATE / "stop-refuses").exists():
        print(f"Error response from daemon: cannot stop container: {{args[-1]}}", file=sys.stderr)
        return 1
    assert args[0] == "-t", args
    pid = signal_container(args[2], signal.SIGTERM)
    if pid is None:
        return 1
    deadline = time.monotonic() + int(args[1])
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    if alive(pid):
        os.killpg(pid, signal.SIGKILL)
    print(args[2])
    return 0


def kill(args):
    if signal_container(args[0], signal.SIGKILL) is None:
        return 1
    print(args[0])
    return 0


append("calls.jsonl", sys.argv[1:])
append("cli_env.jsonl", dict(os.environ))
verbs = {{"run": run, "stop": stop, "kill": kill}}
sys.exit(verbs[sys.argv[1]](sys.argv[2:]))
'''


@dataclass
class FakeRuntime:
    """The stand-in CLI and what it recorded."""

    path: Path
    state: Path

    def calls(self) -> list[list[str]]:
        return self._lines("calls.jsonl")

    def cli_envs(self) -> list[dict[str, str]]:
        """The environment of each invocation of the CLI itself."""
        return self._lines("cli_env.jsonl")

    def containers(self) -> list[dict[str, Any]]:
        return self._lines("containers.jsonl")

    def env_files(self) -> list[dict[str, Any]]:
        """Each ``--env-file`` the runtime was given: its path and the modes of it and its folder."""
        return self._lines("env_files.jsonl")

    def _lines(self, name: str) -> list[Any]:
        try:
            text = (self.state / name).read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines() if line.endswith(("]", "}"))]

    async def started(self, name: str) -> dict[str, Any]:
        """Wait until the container ``name`` runs; its record (pid, cli_pid, image)."""
        def find() -> dict[str, Any] | None:
            return next((c for c in self.containers() if c["name"] == name), None)

        record: dict[str, Any] = await wait_for(find, timeout=DEADLINE_SEC, what=f"container {name} to start")
        return record

    async def all_gone(self) -> None:
        """Wait until no container process and no CLI process started so far is alive."""
        pids = [pid for c in self.containers() for pid in (c["pid"], c["cli_pid"])]
        assert pids, "no container was started"
        await wait_for(lambda: not any(map(pid_alive, pids)), timeout=DEADLINE_SEC, what=f"{pids} to end")


def install_fake_runtime(folder: Path) -> FakeRuntime:
    """Write the stand-in CLI as an executable into ``folder``, with its state folder next to it."""
    state = folder / "state"
    state.mkdir()
    path = folder / "fake-docker"
    path.write_text(FAKE_RUNTIME.format(python=sys.executable, state=str(state)))
    path.chmod(0o755)
    return FakeRuntime(path, state)


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs; zombies count as dead (the container init may never reap them)."""
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (ProcessLookupError, FileNotFoundError):
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"
