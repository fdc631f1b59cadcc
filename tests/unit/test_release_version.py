"""The version a build reports: a release's own number on its release commit, a development version
(X.Y.Z.devN) on every commit after it, one number in both places it is written (docs/operations.md,
"Releasing")."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.version import Version

from chimes import __version__
from chimes.store.migrate import AppliedStep, ReleaseTooOld, refuse_if_too_old, release_key
from chimes.store.upgrades import LiveProcess

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_and_pyproject_report_the_same_version() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == __version__


def test_unreleased_changes_make_a_development_version() -> None:
    """CHANGELOG.md opens with "Unreleased" exactly while the code is between releases."""
    changelog = (ROOT / "CHANGELOG.md").read_text()
    first = re.search(r"^## (.+)$", changelog, re.MULTILINE)
    assert first is not None
    version = Version(__version__)
    if first.group(1).strip() == "Unreleased":
        last = re.search(r"^## (\d+\.\d+\.\d+)", changelog, re.MULTILINE)
        assert last is not None
        assert version.is_devrelease and version > Version(last.group(1)), (
            f"CHANGELOG.md has changes after {last.group(1)}: this build's version is a development version "
            f"after it (X.Y.Z.dev0 of the next release), not {__version__}")
    else:
        assert not version.is_devrelease and first.group(1).startswith(__version__), first.group(1)


def test_a_development_build_counts_as_the_release_it_leads_to() -> None:
    assert release_key("0.3.4.dev0") == release_key("0.3.4") > release_key("0.3.3")
    assert release_key("0.10.0.dev0") > release_key("0.9.1")
    contracted = [AppliedStep(9001, "contract_for_0_3_4", "0.3.4")]
    refuse_if_too_old(contracted, "0.3.4.dev0")  # its own release's contract step: it runs
    with pytest.raises(ReleaseTooOld, match=r"needs chimes 0\.3\.4 or later .* this is chimes 0\.3\.3"):
        refuse_if_too_old(contracted, "0.3.3")
    assert not LiveProcess("worker", "w-1", "0.3.4.dev0").predates("0.3.4")
    assert LiveProcess("worker", "w-1", "0.3.3").predates("0.3.4")
