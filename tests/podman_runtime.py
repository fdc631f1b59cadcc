"""A real container runtime for tests: podman with a tiny local image, no registry needed.

:func:`prepare` builds ``localhost/chimes-test-busybox:1`` with ``podman import`` from a tarball that
holds a static busybox (Debian's ``busybox-static``) and its applet links, writes a
``containers.conf`` without default ulimits, and returns the runtime command line a worker takes as
``--container-runtime``: ``env CONTAINERS_CONF=... podman --runtime runc --cgroup-manager=cgroupfs``
(docs/RECIPES: the default crun refuses hybrid cgroup hosts and the default ulimits; runc with
cgroupfs works). It then runs one container to prove the runtime works. When anything is missing or
refuses to run, it returns the exact reason instead, and the tests skip with it, unless
``CHIMES_REQUIRE_PODMAN=1`` says this machine must run them (then they fail with it).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IMAGE = "localhost/chimes-test-busybox:1"
APPLETS = ("sh", "echo", "sleep", "env", "cat", "true", "printf", "test")
REQUIRE_ENV = "CHIMES_REQUIRE_PODMAN"
_BUSYBOX_PATHS = ("/bin/busybox", "/usr/bin/busybox")
_STEP_TIMEOUT_SEC = 60
#: What :func:`prepare` found in this test session (None: not asked), for the summary line.
verdict: Podman | str | None = None


@dataclass(frozen=True)
class Podman:
    runtime: str  # the worker's --container-runtime
    argv: list[str]

    async def names(self, prefix: str) -> list[str]:
        """Names of the containers (running or not) whose name starts with ``prefix``."""
        proc = await asyncio.create_subprocess_exec(*self.argv, "ps", "-a", "--format", "{{.Names}}",
                                                    stdout=asyncio.subprocess.PIPE)
        async with asyncio.timeout(_STEP_TIMEOUT_SEC):
            out, _ = await proc.communicate()
        assert proc.returncode == 0, f"podman ps failed (exit {proc.returncode})"
        return [name for name in out.decode().split() if name.startswith(prefix)]


def _static_busybox() -> Path | None:
    for candidate in _BUSYBOX_PATHS:
        path = Path(candidate)
        if path.is_file():
            # A dynamically linked busybox would need a libc inside the image: it has no PT_INTERP.
            if b"/ld-linux" not in path.read_bytes()[:4096]:
                return path
    return None


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=_STEP_TIMEOUT_SEC)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def prepare(folder: Path) -> Podman | str:
    """Build the image and check that a container runs; a :class:`Podman`, or why it cannot run."""
    global verdict
    verdict = _prepare(folder)
    return verdict


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Say which runtime container tasks were tested on, when the podman tests were collected."""
    if verdict is None:
        return
    if isinstance(verdict, Podman):
        line = f"container tasks ran on a real runtime ({verdict.runtime}) and on the stand-in CLI"
    else:
        line = f"container tasks ran on the stand-in CLI only; podman tests skipped: {verdict}"
    terminalreporter.write_line(line)


def _prepare(folder: Path) -> Podman | str:
    podman = shutil.which("podman")
    if podman is None:
        return "podman is not installed (scripts/test installs podman, runc and busybox-static with apt-get)"
    busybox = _static_busybox()
    if busybox is None:
        return "no static busybox for the test image (Debian package busybox-static)"
    image = folder / "image"
    (image / "bin").mkdir(parents=True)
    shutil.copy(busybox, image / "bin" / "busybox")
    for applet in APPLETS:
        os.symlink("busybox", image / "bin" / applet)
    with tarfile.open(folder / "busybox.tar", "w") as tar:
        tar.add(image / "bin", arcname="bin")
    conf = folder / "containers.conf"
    conf.write_text("[containers]\ndefault_ulimits = []\n")
    argv = ["env", f"CONTAINERS_CONF={conf}", podman]
    if shutil.which("runc"):
        argv += ["--runtime", "runc", "--cgroup-manager=cgroupfs"]
    imported = _run([*argv, "import", "--quiet", str(folder / "busybox.tar"), IMAGE])
    if imported.returncode != 0:
        return f"podman import failed (exit {imported.returncode}): {_last_line(imported.stderr)}"
    probe = _run([*argv, "run", "--rm", IMAGE, "/bin/sh", "-c", "echo ready"])
    if probe.returncode != 0 or probe.stdout.strip() != "ready":
        return f"podman cannot run a container here (exit {probe.returncode}): {_last_line(probe.stderr)}"
    return Podman(shlex.join(argv), argv)
