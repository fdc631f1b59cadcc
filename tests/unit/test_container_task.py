"""Container tasks against a stand-in for the docker CLI.

No container engine runs on this machine, so the stand-in of :mod:`tests.fake_container_runtime`
replaces the docker CLI: it runs each "container" as a local process outside the CLI's process
group and stops or kills it by name, recording every call. Everything else is real: real
subprocesses, real signals, real process groups.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from chimes.worker.tasks.common import OUTPUT_TAIL_BYTES, Outcome, TaskContext
from chimes.worker.tasks.container import ContainerExecutor, container_name, remove_orphaned_env_files
from chimes.worker.tasks.dispatch import Executors
from tests.fake_container_runtime import DEADLINE_SEC, FakeRuntime, install_fake_runtime, pid_alive
from tests.helpers import wait_for


@pytest.fixture
def fake(tmp_path: Path) -> FakeRuntime:
    return install_fake_runtime(tmp_path)


def make_ctx(timeout_sec: float = 30.0) -> TaskContext:
    scheduled = datetime(2026, 12, 1, 9, 0, 0, tzinfo=UTC)
    return TaskContext("run-123", "job-abc", 2, scheduled, timeout_sec)


NAME = container_name(make_ctx())


def container(*command: str, image: str = "alpine:3", **extra: Any) -> dict[str, Any]:
    return {"type": "container", "image": image, "command": list(command), **extra}


def sh(script: str, **extra: Any) -> dict[str, Any]:
    return container("/bin/sh", "-c", script, **extra)


async def test_success_passes_env_and_keeps_output(fake: FakeRuntime) -> None:
    script = 'echo "$CHIMES_RUN_ID|$CHIMES_JOB_ID|$CHIMES_ATTEMPT|$CHIMES_SCHEDULED_AT|$FOO"; echo err >&2'
    task = sh(script, env={"FOO": "bar", "CHIMES_RUN_ID": "forged"})
    outcome = await ContainerExecutor(str(fake.path)).run(task, make_ctx())
    assert outcome == Outcome.success("run-123|job-abc|2|2026-12-01T09:00:00Z|bar\nerr\n")
    assert NAME == "chimes-run-123-2"
    [run] = fake.calls()
    [env_file] = fake.env_files()
    identity_flags = [
        "--env", "CHIMES_RUN_ID=run-123", "--env", "CHIMES_JOB_ID=job-abc",
        "--env", "CHIMES_ATTEMPT=2", "--env", "CHIMES_SCHEDULED_AT=2026-12-01T09:00:00Z",
    ]
    assert run == ["run", "--rm", "--name", NAME, "--env-file", env_file["path"], *identity_flags, "alpine:3",
                   "/bin/sh", "-c", script]
    await fake.all_gone()


async def test_task_env_stays_off_the_command_line_and_is_removed_after_the_run(fake: FakeRuntime) -> None:
    # Secret values are opened into env before the executor sees them (chimes.security.secrets.reveal).
    task = sh('printf "%s|%s" "$TOKEN" "$SPACED"', env={"TOKEN": "s3cret-value", "SPACED": " a = b "})
    outcome = await ContainerExecutor(str(fake.path)).run(task, make_ctx())
    assert outcome == Outcome.success("s3cret-value| a = b ")
    [run] = fake.calls()
    assert not any("s3cret" in arg for arg in run)
    [env_file] = fake.env_files()
    assert (env_file["mode"], env_file["folder_mode"]) == ("0o600", "0o700")
    assert Path(env_file["path"]).parent.name.startswith(f"chimes-env-{os.getpid()}-")
    assert _gone(Path(env_file["path"]).parent)
    await fake.all_gone()


def _gone(path: Path) -> bool:
    return not path.exists()


def test_env_folders_of_dead_workers_are_removed_and_those_of_live_ones_kept(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for pid in (dead.pid, os.getpid()):
        folder = tmp_path / f"chimes-env-{pid}-x1y2"
        folder.mkdir(mode=0o700)
        (folder / "env").write_text("TOKEN=s3cret\n")
    (tmp_path / "chimes-env-notapid").mkdir()
    assert remove_orphaned_env_files(tmp_path) == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == [f"chimes-env-{os.getpid()}-x1y2", "chimes-env-notapid"]
    assert remove_orphaned_env_files(tmp_path) == 0


async def test_a_line_break_in_an_env_value_fails_the_run_before_anything_starts(fake: FakeRuntime) -> None:
    outcome = await ContainerExecutor(str(fake.path)).run(sh("true", env={"PEM": "line 1\nline 2"}), make_ctx())
    assert not outcome.succeeded
    assert outcome.error == ("cannot pass the task's environment: a container env value contains a line break, "
                             "which an env file cannot carry")
    assert fake.calls() == []


async def test_without_task_env_there_is_no_env_file(fake: FakeRuntime) -> None:
    assert (await ContainerExecutor(str(fake.path)).run(sh("true"), make_ctx())).succeeded
    [run] = fake.calls()
    assert "--env-file" not in run and fake.env_files() == []


async def test_output_tail_is_capped_and_empty_command_uses_image_default(fake: FakeRuntime) -> None:
    executor = ContainerExecutor(str(fake.path))
    chatty = await executor.run(sh("yes abcdefghi | head -c 100000; printf THE-END"), make_ctx())
    assert chatty.succeeded, chatty
    assert chatty.output is not None
    assert len(chatty.output) == OUTPUT_TAIL_BYTES
    assert chatty.output.endswith("THE-END")
    default = await executor.run(container(image="busybox"), make_ctx())
    assert default == Outcome.success("default command of busybox\n")
    assert fake.calls()[-1][-1] == "busybox"


async def test_nonzero_exit(fake: FakeRuntime) -> None:
    outcome = await ContainerExecutor(str(fake.path)).run(sh("echo partial; exit 3"), make_ctx())
    assert outcome == Outcome.failure("exit code 3", "partial\n")


async def test_runtime_errors_name_the_cause(fake: FakeRuntime) -> None:
    executor = ContainerExecutor(str(fake.path))
    pull = await executor.run(container(image="no-such-image"), make_ctx())
    assert pull.succeeded is False
    assert pull.error == "container runtime error (exit 125): docker: Error response from daemon: pull access " \
                         "denied for no-such-image"
    assert pull.output is not None and "Unable to find image" in pull.output
    missing = await executor.run(container("chimes-not-in-image"), make_ctx())
    assert missing.error == (
        'container runtime error (exit 127): docker: exec: "chimes-not-in-image": executable file not found in $PATH'
    )


async def test_timeout_stops_the_container(fake: FakeRuntime) -> None:
    executor = ContainerExecutor(str(fake.path), kill_grace_sec=3.0)
    outcome = await executor.run(sh("echo started; exec sleep 60"), make_ctx(timeout_sec=2.0))
    assert outcome == Outcome.failure("timed out after 2s", "started\n")
    # The stand-in runs the "container" outside the CLI's process group: only `stop` could end it.
    assert [call[0] for call in fake.calls()] == ["run", "stop"]
    assert fake.calls()[1] == ["stop", "-t", "3", NAME]
    await fake.all_gone()


async def test_timeout_kills_when_stop_fails(fake: FakeRuntime) -> None:
    (fake.state / "stop-refuses").touch()
    outcome = await ContainerExecutor(str(fake.path), kill_grace_sec=1.0).run(
        sh("exec sleep 60"), make_ctx(timeout_sec=2.0)
    )
    assert outcome.error == "timed out after 2s"
    assert [call[0] for call in fake.calls()] == ["run", "stop", "kill"]
    assert fake.calls()[2] == ["kill", NAME]
    await fake.all_gone()


async def test_cancellation_stops_the_container(fake: FakeRuntime) -> None:
    executor = ContainerExecutor(str(fake.path), kill_grace_sec=5.0)
    task = asyncio.create_task(executor.run(sh("exec sleep 60"), make_ctx()))
    record = await fake.started(NAME)
    assert pid_alive(record["pid"]) and pid_alive(record["cli_pid"])
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fake.calls()[1:] == [["stop", "-t", "5", NAME]]
    await fake.all_gone()


async def test_second_cancellation_does_not_interrupt_the_stop(fake: FakeRuntime) -> None:
    executor = ContainerExecutor(str(fake.path), kill_grace_sec=2.0)
    # The container ignores SIGTERM, so `stop` takes its whole grace and then kills it.
    task = asyncio.create_task(executor.run(sh("trap '' TERM; sleep 60 & wait"), make_ctx()))
    await fake.started(NAME)
    task.cancel()
    await wait_for(lambda: len(fake.calls()) == 2, timeout=DEADLINE_SEC, what="stop to be called")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await fake.all_gone()


async def test_missing_runtime_and_bad_image(fake: FakeRuntime) -> None:
    missing = await ContainerExecutor("chimes-no-such-runtime").run(sh("true"), make_ctx())
    assert missing.error == "container runtime 'chimes-no-such-runtime' not found; set --container-runtime"
    option_like = await ContainerExecutor(str(fake.path)).run(container(image="--privileged"), make_ctx())
    assert option_like == Outcome.failure("invalid image '--privileged'")
    assert fake.calls() == []
    with pytest.raises(ValueError, match="the container runtime command is empty"):
        ContainerExecutor("  ")
    with pytest.raises(ValueError, match="cannot parse the container runtime command"):
        ContainerExecutor("'unbalanced")


async def test_runtime_with_arguments(fake: FakeRuntime) -> None:
    runtime = f"{shlex.quote(sys.executable)} {shlex.quote(str(fake.path))}"
    outcome = await ContainerExecutor(runtime).run(container("echo", "hello"), make_ctx())
    assert outcome == Outcome.success("hello\n")
    assert fake.calls()[0][:4] == ["run", "--rm", "--name", NAME]


async def test_executors_dispatch_container_tasks(fake: FakeRuntime) -> None:
    executors = Executors(container_runtime=str(fake.path))
    try:
        outcome = await executors.run(container("echo", "dispatched"), make_ctx())
    finally:
        await executors.close()
    assert outcome == Outcome.success("dispatched\n")


async def test_the_runtime_cli_gets_no_chimes_or_database_settings(
    fake: FakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHIMES_SECRET_KEY", "worker-secret-key")
    monkeypatch.setenv("CHIMES_DATABASE_URL", "postgresql://chimes:db-password@db/chimes")
    monkeypatch.setenv("DATABASE_URL", "postgresql://chimes:db-password@db/chimes")
    monkeypatch.setenv("PGPASSWORD", "db-password")
    monkeypatch.setenv("DOCKER_HOST", "unix:///run/user/1000/docker.sock")
    outcome = await ContainerExecutor(str(fake.path)).run(sh("env", env={"FOO": "bar"}), make_ctx())
    assert outcome.succeeded and outcome.output is not None, outcome
    [cli_env] = fake.cli_envs()
    assert not {"CHIMES_SECRET_KEY", "CHIMES_DATABASE_URL", "DATABASE_URL", "PGPASSWORD"} & set(cli_env)
    assert cli_env["DOCKER_HOST"] == "unix:///run/user/1000/docker.sock", "what the runtime needs stays"
    for leaked in ("worker-secret-key", "db-password"):
        assert leaked not in outcome.output, "nor does the container get them"
    assert "FOO=bar" in outcome.output
