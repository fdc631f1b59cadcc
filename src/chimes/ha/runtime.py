"""Where Patroni and etcd come from, and as whom they run.

PostgreSQL refuses to run as root, so Patroni, which starts it, runs as the same system user as the
embedded server (``embedded_postgres``) when Chimes runs as root, and as the current user otherwise.
That user must be able to execute the Python that runs Patroni: the interpreter of Chimes' own
virtual environment often lives in root's home, so the system's ``/usr/bin/python3`` is the fallback.
Patroni and its PostgreSQL driver are installed from the package index into a folder of the
cluster's own (``pip install --target``) the first time, readable by that user. etcd is Debian's
``etcd-server``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from chimes.store.embedded import SYSTEM_USER, system_user

PATRONI_REQUIREMENTS = ("patroni[etcd3]>=4.0", "psycopg[binary]>=3.1")
SYSTEM_PYTHON = "/usr/bin/python3"


class HaUnavailable(RuntimeError):
    """What a highly available cluster needs is missing here; the message says what and how to get it."""


def run_as() -> str | None:
    """The user Patroni and PostgreSQL run as: the embedded server's system user under root."""
    if os.geteuid() != 0:
        return None
    system_user(SYSTEM_USER)
    return SYSTEM_USER


def as_user(command: list[str]) -> list[str]:
    """``command`` run as :func:`run_as`, exec'd in place (no extra process between), so that the pid
    a caller holds is the program's own."""
    user = run_as()
    if user is None:
        return command
    return ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *command]


def etcd_binary() -> str:
    found = shutil.which("etcd")
    if found is None:
        raise HaUnavailable("etcd is not installed: `apt-get install etcd-server` (Debian) provides it")
    return found


def _version_of(python: str) -> str | None:
    try:
        done = subprocess.run(as_user([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]),
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def patroni_python() -> str:
    """An interpreter of Chimes' own Python version that the Patroni user can execute."""
    mine = f"{sys.version_info[0]}.{sys.version_info[1]}"
    # The system's first: a virtual environment's interpreter is a link into the base installation,
    # and where the Patroni user cannot follow it the result is not the interpreter it names.
    for candidate in (SYSTEM_PYTHON, os.path.realpath(sys.executable)):
        if _version_of(candidate) == mine:
            return candidate
    raise HaUnavailable(
        f"no Python {mine} that the user {run_as() or 'running Chimes'} may execute: Patroni runs as that user "
        f"(PostgreSQL refuses root). Install Debian's python3 of that version, or run Chimes from a "
        f"virtual environment outside root's home")


def ensure_patroni(site: Path) -> Path:
    """Install Patroni into ``site`` unless it is there; returns ``site`` (the PYTHONPATH for it)."""
    marker = site / ".chimes-installed"
    if not marker.exists():
        site.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                               "--target", str(site), *PATRONI_REQUIREMENTS], capture_output=True, text=True)
        if done.returncode != 0:
            raise HaUnavailable(f"could not install {' '.join(PATRONI_REQUIREMENTS)}: {done.stderr[-2000:]}")
        marker.touch()
    site.chmod(site.stat().st_mode | 0o055)  # the packages themselves are installed world-readable
    allow_traversal(site)
    return site


def allow_traversal(path: Path) -> None:
    """Let the Patroni user pass through every folder above ``path`` (execute permission only, as the
    embedded server's data folder needs too)."""
    for folder in path.parents:
        mode = folder.stat().st_mode
        if mode & 0o011 != 0o011:
            folder.chmod(mode | 0o011)
