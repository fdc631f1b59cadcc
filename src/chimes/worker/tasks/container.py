"""Container tasks: run an image through a docker-compatible CLI and judge the run by its exit status.

The worker speaks to no engine API. It runs ``<runtime> run --rm --name chimes-<run>-<attempt> ...``
(docker, podman and nerdctl take the same arguments) as a local process group, exactly like a
command task, and reads the container's output from that CLI. Killing the CLI does not stop the
container, so on timeout or cancellation the container is stopped by name (``stop -t GRACE``; if the
CLI stays attached, the CLI's group is killed and then the container with ``kill``).

The task's environment (secret values included) reaches the runtime in an env file readable by the
worker's user only, removed when the run ends: on the command line, every user of the host could
read it in the process list. Only the run identity (``CHIMES_*``) is passed as ``--env``. The runtime
CLI itself runs without the worker's own settings (:func:`runtime_env`). A worker
killed mid-run cannot remove its files; the folder names carry the worker's pid, and a worker starting
on the same host removes those of workers no longer alive (:func:`remove_orphaned_env_files`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import shlex
import shutil
import tempfile
from collections.abc import Coroutine, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from chimes.settings import CONTAINER_RUNTIME, KILL_GRACE_SEC
from chimes.worker.tasks.common import OUTPUT_TAIL_BYTES, Outcome, OutputTail, TaskContext, format_seconds, short_error
from chimes.worker.tasks.processes import (
    drain_output,
    exit_error,
    pump_output,
    run_identity_env,
    spawn_in_group,
    stop_process_group,
)

__all__ = ["RUNTIME_ERROR_CODES", "ContainerExecutor", "container_name", "remove_orphaned_env_files", "run_argv",
           "task_env_file"]

log = logging.getLogger(__name__)

#: Exit statuses with which ``docker run`` reports its own failure (daemon error, command not
#: executable, command not found) rather than the container command's.
RUNTIME_ERROR_CODES = frozenset({125, 126, 127})
#: Extra seconds a ``stop``/``kill`` command may take beyond the stop grace before it is abandoned.
_CONTROL_SLACK_SEC = 10.0
#: After a successful ``stop`` the attached CLI exits at once; this long without exit means it did not work.
_CLI_EXIT_AFTER_STOP_SEC = 2.0
#: Grace for the CLI's own group once the container is stopped: nothing worth waiting for is left in it.
_CLI_KILL_GRACE_SEC = 1.0
_USAGE_HINT = re.compile(r"^(Run|See) '.*--help'")
_ENV_FOLDER = re.compile(r"^chimes-env-(\d+)-")


def runtime_env() -> dict[str, str]:
    """The worker's environment less Chimes' settings (``CHIMES_*``: the secret key, the database URL)
    and PostgreSQL's (``PG*``, ``DATABASE_URL``), for the runtime CLI: it needs ``DOCKER_HOST``,
    ``XDG_RUNTIME_DIR`` and the like, and nothing of the worker's. The container itself gets only its
    env file and the run identity."""
    return {name: value for name, value in os.environ.items()
            if not name.startswith(("CHIMES_", "PG")) and name != "DATABASE_URL"}


def container_name(ctx: TaskContext) -> str:
    """Unique per attempt, so a retry never collides with a container its predecessor left behind."""
    return f"chimes-{ctx.run_id}-{int(ctx.attempt)}"


def run_argv(runtime: list[str], task: dict[str, Any], ctx: TaskContext, env_file: str | None = None) -> list[str]:
    """``<runtime> run --rm --name NAME [--env-file FILE] --env CHIMES_...=V ... IMAGE [COMMAND...]``.

    ``env_file`` holds the task's own variables (see :func:`task_env_file`); the run identity is
    never taken from the task.
    """
    env_flags = [arg for key, value in run_identity_env(ctx).items() for arg in ("--env", f"{key}={value}")]
    file_flags = ["--env-file", env_file] if env_file else []
    command = [str(arg) for arg in task.get("command") or ()]
    return [*runtime, "run", "--rm", "--name", container_name(ctx), *file_flags, *env_flags, str(task["image"]),
            *command]


@contextmanager
def task_env_file(task: dict[str, Any], ctx: TaskContext) -> Iterator[str | None]:
    """The task's variables (its ``env``, secret values opened) in a ``KEY=VALUE`` file, in a folder of
    mode 0700, for as long as the run lasts; None when there are none. The API refuses line breaks in
    container env values, which the format cannot carry."""
    identity = run_identity_env(ctx)
    env = {str(k): str(v) for k, v in (task.get("env") or {}).items() if str(k) not in identity}
    if not env:
        yield None
        return
    if any("\n" in value or "\r" in value for value in env.values()):
        raise ValueError("a container env value contains a line break, which an env file cannot carry")
    # 0700: only the worker's user can look inside. The pid lets a later worker remove it after a crash.
    folder = Path(tempfile.mkdtemp(prefix=f"chimes-env-{os.getpid()}-"))
    try:
        path = folder / "env"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.writelines(f"{key}={value}\n" for key, value in env.items())
        yield str(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def remove_orphaned_env_files(folder: Path | None = None) -> int:
    """Remove the env folders that workers killed mid-run (SIGKILL, out of memory) left in the
    temporary folder: they hold secret values. Folders of live processes stay; returns how many went."""
    removed = 0
    for path in Path(folder or tempfile.gettempdir()).glob("chimes-env-*"):
        match = _ENV_FOLDER.match(path.name)
        if match is None or not path.is_dir() or _process_alive(int(match[1])):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed += not path.exists()
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and its folder is not ours to judge
        return True
    return True


def _last_line(text: str | None) -> str:
    """The last line that says something: docker ends its errors with a "Run 'docker run --help'" hint."""
    lines = [line.strip() for line in (text or "").splitlines()]
    lines = [line for line in lines if line and not _USAGE_HINT.match(line)]
    return lines[-1] if lines else ""


def _exit_outcome(returncode: int, output: str | None) -> Outcome:
    if returncode == 0:
        return Outcome.success(output)
    if returncode in RUNTIME_ERROR_CODES:
        line = _last_line(output)
        message = f"container runtime error (exit {returncode})" + (f": {line}" if line else "")
        return Outcome.failure(short_error(message), output)
    return Outcome.failure(exit_error(returncode), output)


async def _finish_despite_cancellation(cleanup: Coroutine[Any, Any, None]) -> None:
    """Run ``cleanup`` to its end even if the caller is cancelled again meanwhile, then re-raise that.

    The worker re-cancels a run on every heartbeat while its lease is gone; an interrupted ``stop``
    would leave the container running, and each step of the cleanup is bounded anyway.
    """
    task = asyncio.ensure_future(cleanup)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    task.result()
    if cancelled:
        raise asyncio.CancelledError


class ContainerExecutor:
    """Runs ``{"type": "container"}`` tasks through ``runtime``, a command line such as ``sudo podman``."""

    def __init__(self, runtime: str = CONTAINER_RUNTIME, *, kill_grace_sec: float = KILL_GRACE_SEC) -> None:
        self.runtime = runtime
        try:
            self._runtime_argv = shlex.split(runtime)
        except ValueError as exc:
            raise ValueError(f"cannot parse the container runtime command {runtime!r}: {exc}") from None
        if not self._runtime_argv:
            raise ValueError("the container runtime command is empty")
        self._kill_grace_sec = kill_grace_sec

    async def run(self, task: dict[str, Any], ctx: TaskContext) -> Outcome:
        """Run the container to completion or timeout; never raises except on cancellation."""
        image = str(task.get("image") or "")
        if not image or image.startswith("-"):  # the runtime would read it as an option
            return Outcome.failure(short_error(f"invalid image {image!r}"))
        with ExitStack() as cleanup:
            try:
                env_file = cleanup.enter_context(task_env_file(task, ctx))
            except (OSError, ValueError) as exc:
                return Outcome.failure(short_error(f"cannot pass the task's environment: {exc}"))
            return await self._start_and_supervise(task, ctx, env_file)

    async def _start_and_supervise(self, task: dict[str, Any], ctx: TaskContext, env_file: str | None) -> Outcome:
        try:
            proc = await spawn_in_group(run_argv(self._runtime_argv, task, ctx, env_file), runtime_env())
        except FileNotFoundError:
            return Outcome.failure(f"container runtime {self.runtime!r} not found; set --container-runtime")
        except PermissionError:
            return Outcome.failure(f"permission denied running container runtime {self.runtime!r}")
        except (OSError, ValueError) as exc:
            return Outcome.failure(short_error(f"cannot start container runtime: {type(exc).__name__}: {exc}"))
        return await self._supervise(proc, container_name(ctx), ctx)

    async def _supervise(self, proc: asyncio.subprocess.Process, name: str, ctx: TaskContext) -> Outcome:
        tail = OutputTail(OUTPUT_TAIL_BYTES)
        try:
            async with asyncio.timeout(ctx.timeout_sec):
                await pump_output(proc, tail)
                returncode = await proc.wait()
        except TimeoutError:
            await _finish_despite_cancellation(self._stop(proc, name, tail, ctx))
            return Outcome.failure(f"timed out after {format_seconds(ctx.timeout_sec)}s", tail.text())
        except BaseException:  # cancellation (or anything unexpected): leave no container behind
            await _finish_despite_cancellation(self._stop(proc, name, tail, ctx))
            raise
        return _exit_outcome(returncode, tail.text())

    async def _stop(self, proc: asyncio.subprocess.Process, name: str, tail: OutputTail, ctx: TaskContext) -> None:
        """Stop the container gracefully, kill it if the CLI stays attached, then end the CLI's group."""
        # Whole seconds, and -t: docker, podman and nerdctl all accept it (docker deprecated --time for --timeout).
        grace = str(math.ceil(max(0.0, self._kill_grace_sec)))
        try:
            stopped = await self._control(["stop", "-t", grace, name], self._kill_grace_sec + _CONTROL_SLACK_SEC, ctx)
            if not await _exits_within(proc, _CLI_EXIT_AFTER_STOP_SEC if stopped else 0.0):
                # The CLI goes first: once it is gone it cannot start the container after the kill below.
                await stop_process_group(proc, _CLI_KILL_GRACE_SEC)
                await self._control(["kill", name], _CONTROL_SLACK_SEC, ctx)
        finally:
            await stop_process_group(proc, _CLI_KILL_GRACE_SEC)
            await drain_output(proc, tail)

    async def _control(self, args: list[str], limit_sec: float, ctx: TaskContext) -> bool:
        """Run ``<runtime> ARGS`` with a time limit; whether it exited 0 (failures are logged, not raised)."""
        output = OutputTail(OUTPUT_TAIL_BYTES)
        try:
            proc = await spawn_in_group([*self._runtime_argv, *args], runtime_env())
        except OSError as exc:
            log.warning("cannot run the container runtime for %s: %s", args[0], exc, extra={"run_id": ctx.run_id})
            return False
        try:
            async with asyncio.timeout(limit_sec):
                await pump_output(proc, output)
                returncode = await proc.wait()
        except BaseException as exc:  # a hung runtime must not outlive the cleanup either
            await stop_process_group(proc, 0.0)
            await drain_output(proc, output)
            if not isinstance(exc, TimeoutError):
                raise
            log.warning("container %s gave no answer within %ss", args[0], format_seconds(limit_sec),
                        extra={"run_id": ctx.run_id})
            return False
        if returncode != 0:
            log.warning("container %s failed (%s): %s", args[0], exit_error(returncode), _last_line(output.text()),
                        extra={"run_id": ctx.run_id})
        return returncode == 0


async def _exits_within(proc: asyncio.subprocess.Process, seconds: float) -> bool:
    if proc.returncode is not None:
        return True
    try:
        async with asyncio.timeout(seconds):
            await proc.wait()
    except TimeoutError:
        return False
    return True
