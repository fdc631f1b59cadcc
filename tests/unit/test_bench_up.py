"""`python -m bench up`'s arguments, checked as they are read: before any PostgreSQL or `chimes up` starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.__main__ import _parser


def test_a_profile_folder_that_is_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "profiles"
    a_file.write_text("not a folder")
    with pytest.raises(SystemExit):
        _parser().parse_args(["up", "--profile", str(a_file)])
    assert f"argument --profile: {a_file} is a file; give a folder" in capsys.readouterr().err
    assert a_file.read_text() == "not a folder"


def test_a_profile_folder_is_taken_whether_or_not_it_exists_yet(tmp_path: Path) -> None:
    assert _parser().parse_args(["up", "--profile", str(tmp_path)]).profile == tmp_path
    assert _parser().parse_args(["up", "--profile", str(tmp_path / "new")]).profile == tmp_path / "new"
