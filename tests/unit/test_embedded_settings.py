"""The embedded server's settings: shared buffers follow the machine (a quarter of its memory, 128 MB to
2 GB); WAL archiving copies each segment once, whole, and never over another."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from chimes.store.embedded import SERVER_SETTINGS, Archiving, archive_command, shared_buffers_mb

GB = 2**30


def test_shared_buffers_are_a_quarter_of_memory_within_bounds() -> None:
    assert shared_buffers_mb(4 * GB) == 1024
    assert shared_buffers_mb(256 * 2**20) == 128  # a small machine still gets PostgreSQL's usual minimum
    assert shared_buffers_mb(64 * GB) == 2048  # a big one: enough for a million schedules' burst, no more
    assert SERVER_SETTINGS["shared_buffers"] == f"{shared_buffers_mb()}MB"


def _archive(command: str, segment: Path, wal_dir: Path) -> int:
    """Run archive_command as PostgreSQL does: %p and %f substituted, through the shell."""
    line = command.replace("%p", str(segment)).replace("%f", segment.name)
    return subprocess.run(["sh", "-c", line], check=False).returncode


def test_archive_command_copies_once_and_never_over_another_segment(tmp_path: Path) -> None:
    wal_dir = tmp_path / "backups" / "wal"
    wal_dir.mkdir(parents=True)
    segment = tmp_path / "000000010000000000000007"
    segment.write_bytes(b"first")
    command = archive_command(wal_dir)
    assert _archive(command, segment, wal_dir) == 0
    assert (wal_dir / segment.name).read_bytes() == b"first"
    assert [p.name for p in wal_dir.iterdir()] == [segment.name], "a partial copy was left"
    assert _archive(command, segment, wal_dir) == 0, "archiving the same segment again (after a crash) must succeed"
    segment.write_bytes(b"other")
    assert _archive(command, segment, wal_dir) != 0, "a different segment of the same name was accepted"
    assert (wal_dir / segment.name).read_bytes() == b"first"


def test_archiving_settings_and_unsafe_folders(tmp_path: Path) -> None:
    on = Archiving(tmp_path / "b", timeout_sec=30).conf()
    assert "archive_mode = on" in on and "archive_timeout = 30" in on and str(tmp_path / "b" / "wal") in on
    assert "archive_mode = off" in Archiving(None).conf()
    with pytest.raises(ValueError, match="may not contain"):
        Archiving(tmp_path / "it's").conf()
