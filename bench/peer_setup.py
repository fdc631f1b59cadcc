"""What the peers of ``python -m bench peers`` need, installed where it can be, so that the command
works on a fresh machine: the Python packages of the ``bench`` extra (pyproject.toml) with pip, and
Debian's ``redis-server`` for Celery with apt-get (as root). A peer whose needs cannot be met is
skipped with one line saying why; the others, and Chimes, are still measured.

:func:`plan` decides from a :class:`Machine` (what is there); :func:`prepare` looks at the machine,
runs the installs the plan names and plans again, so that an install that failed becomes a skip.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import invalidate_caches
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


@dataclass(frozen=True)
class Needs:
    """``check``: the distributions the peer imports; ``install``: the names of the ``bench``
    extra's requirements that bring them (their specifiers come from pyproject.toml)."""

    check: tuple[str, ...]
    install: tuple[str, ...]
    redis_server: bool = False


NEEDS = {
    "procrastinate": Needs(("procrastinate", "psycopg"), ("procrastinate", "psycopg")),
    "pgqueuer": Needs(("pgqueuer",), ("pgqueuer",)),
    "celery": Needs(("celery", "redis"), ("celery",), redis_server=True),
}


@dataclass(frozen=True)
class Machine:
    installed: frozenset[str]  # the distributions of NEEDS present, lower-case
    pip: bool  # ``python -m pip`` works in this interpreter
    redis_server: bool
    root: bool
    apt_get: bool


@dataclass
class Plan:
    pip: list[str] = field(default_factory=list)  # requirements, as the extra spells them
    apt: list[str] = field(default_factory=list)  # Debian packages
    skips: dict[str, str] = field(default_factory=dict)  # peer: why it is not measured

    def runs(self, systems: Iterable[str]) -> list[str]:
        return [s for s in systems if s not in self.skips]


def bench_extra(pyproject: Path = PYPROJECT) -> dict[str, str]:
    """The ``bench`` extra's requirements by distribution name, lower-case."""
    requirements = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["bench"]
    return {_name(req): req for req in requirements}


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert match, requirement
    return match.group(0).lower()


def plan(systems: Iterable[str], machine: Machine, extra: dict[str, str], *, install: bool = True) -> Plan:
    """What to install for the peers among ``systems``, and which to skip. ``install`` False: nothing
    more is installed (the second look, after the installs ran): whatever is missing is a skip."""
    result = Plan()
    for system in systems:
        needs = NEEDS.get(system)
        if needs is None:  # chimes: nothing beyond Chimes itself
            continue
        why: list[str] = []
        pip: list[str] = []
        apt: list[str] = []
        missing = [name for name in needs.check if name not in machine.installed]
        if missing:
            if not install:
                why.append(f"{', '.join(missing)} could not be installed with pip")
            elif not machine.pip:
                why.append(f"{', '.join(missing)} not installed and this Python has no pip "
                           "(pip install -e '.[bench]')")
            else:
                pip = [extra[name] for name in needs.install]
        if needs.redis_server and not machine.redis_server:
            if not install:
                why.append("redis-server (its broker) could not be installed with apt-get")
            elif not machine.apt_get:
                why.append("redis-server (its broker) is not installed and there is no apt-get to install it")
            elif not machine.root:
                why.append("redis-server (its broker) is not installed, and installing it needs root: "
                           "sudo apt-get install -y redis-server")
            else:
                apt = ["redis-server"]
        if why:  # nothing is installed for a peer that is skipped anyway
            result.skips[system] = "; ".join(why)
            continue
        result.pip += [req for req in pip if req not in result.pip]
        result.apt += [pkg for pkg in apt if pkg not in result.apt]
    return result


def look() -> Machine:
    """What this machine has now."""
    invalidate_caches()  # a distribution pip just installed is seen
    installed = set()
    for needs in NEEDS.values():
        for name in needs.check:
            try:
                version(name)
            except PackageNotFoundError:
                continue
            installed.add(name)
    has_pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0
    return Machine(frozenset(installed), has_pip, shutil.which("redis-server") is not None,
                   os.geteuid() == 0, shutil.which("apt-get") is not None)


def prepare(systems: list[str], say: Callable[[str], None]) -> list[str]:
    """Install what the peers among ``systems`` need where possible; the systems to measure, with a
    line said for each peer skipped."""
    extra = bench_extra()
    first = plan(systems, look(), extra)
    if first.pip:
        say(f"installing for the peers: pip install {' '.join(first.pip)}")
        _run([sys.executable, "-m", "pip", "install", "--quiet", *first.pip], say)
    if first.apt:
        say(f"installing for the peers: apt-get install -y {' '.join(first.apt)}")
        # A fresh machine's package lists may be empty or stale: update once if the install fails.
        if not _run(["apt-get", "install", "-y", "--no-install-recommends", *first.apt], say, quiet=True):
            _run(["apt-get", "update"], say)
            _run(["apt-get", "install", "-y", "--no-install-recommends", *first.apt], say)
    skips = dict(first.skips)
    if first.pip or first.apt:
        skips |= plan(first.runs(systems), look(), extra, install=False).skips
    for system, why in skips.items():
        say(f"skipping {system}: {why}")
    return [s for s in systems if s not in skips]


def _run(argv: list[str], say: Callable[[str], None], *, quiet: bool = False) -> bool:
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode != 0 and not quiet:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        say(f"{argv[0] if argv[0] != sys.executable else 'pip'} failed ({done.returncode}): {' | '.join(tail)}")
    return done.returncode == 0
