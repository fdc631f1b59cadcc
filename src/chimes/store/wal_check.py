"""Whether a restore's replay reached the end of the archived WAL, and if not, which file stopped it.

PostgreSQL ends archive recovery at the first segment ``restore_command`` cannot fetch, or the first
record it cannot read, exactly as it does at the true end of the archive: a segment missing,
corrupt or unreadable in the middle looks like the end, and the server promotes with whatever came
before it. So the archive is read again from where replay stopped, with ``pg_waldump`` and as the
server's user: at a clean end it asks for the segment after the archive's last one; anything else
is the file that cut the replay short.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from chimes.store.embedded import BIN_DIR

SEGMENT_NAME = re.compile(r"^[0-9A-F]{24}$")
REDO_DONE = re.compile(r"redo done at ([0-9A-F]+/[0-9A-F]+)")
QUOTED_SEGMENT = re.compile(r"\"([0-9A-F]{24})\"|WAL segment ([0-9A-F]{24})")
LSN = re.compile(r"\b([0-9A-F]+/[0-9A-F]+)\b")


@dataclass(frozen=True)
class Problem:
    """Why replay stopped short of the archive's end: ``kind`` is ``missing``, ``unreadable``,
    ``corrupt``, or ``unknown`` (the server did not say where replay ended); ``path`` the file;
    ``detail`` pg_waldump's own words."""

    kind: str
    path: Path | None
    detail: str

    def describe(self, reader: str) -> str:
        if self.kind == "missing":
            return f"the archived WAL has a gap: {self.path} is missing ({self.detail})"
        if self.kind == "unreadable":
            return f"permission denied: {reader} cannot read {self.path}"
        if self.kind == "corrupt":
            return f"{self.path} is corrupt ({self.detail})"
        return self.detail


UNKNOWN_END = Problem("unknown", None, "the server did not log where replay ended (no \"redo done at\" line), so "
                                       "whether it reached the end of the archived WAL is not known")


def segments(wal: Path, timeline: int) -> list[str]:
    """The archived segments of ``timeline``, oldest first (their names sort as their positions)."""
    if not wal.is_dir():
        return []
    prefix = f"{timeline:08X}"
    return sorted(p.name for p in wal.iterdir() if SEGMENT_NAME.match(p.name) and p.name.startswith(prefix))


def segment_of(lsn: str, timeline: int, segment_bytes: int) -> str:
    """The name of the segment file of ``timeline`` that holds ``lsn`` (``X/Y``)."""
    high, low = lsn.split("/")
    number = ((int(high, 16) << 32) | int(low, 16)) // segment_bytes
    per_id = 0x1_0000_0000 // segment_bytes
    return f"{timeline:08X}{number // per_id:08X}{number % per_id:08X}"


def end_of(segment: str, segment_bytes: int) -> str:
    """The position just past ``segment``'s last byte."""
    per_id = 0x1_0000_0000 // segment_bytes
    end = (int(segment[8:16], 16) * per_id + int(segment[16:], 16) + 1) * segment_bytes
    return f"{end >> 32:X}/{end & 0xFFFF_FFFF:X}"


def redo_done_at(log_text: str) -> str | None:
    """Where the last record replayed begins, as the server logged it at the end of replay."""
    found = REDO_DONE.findall(log_text)
    return found[-1] if found else None


def unreadable(wal: Path, timeline: int, first: str, user: str | None) -> list[Path]:
    """The archived segments from ``first`` on that ``user`` (None: this process's) cannot read:
    asked of the system, as that user, so modes, owners and ACLs all count."""
    needed = [name for name in segments(wal, timeline) if name >= first]
    if not needed:
        return []
    found = subprocess.run(["find", str(wal), "-mindepth", "1", "-maxdepth", "1", "!", "-readable", "-print"],
                           user=user, cwd="/", capture_output=True, text=True, timeout=600, check=False)
    refused = {Path(line).name for line in found.stdout.splitlines()}
    return [wal / name for name in needed if name in refused]


def first_problem(wal: Path, timeline: int, lsn: str, segment_bytes: int, user: str | None) -> Problem | None:
    """What keeps the archive from being read past ``lsn`` (a record replay ended on), or None when
    replay reached its end."""
    archived = segments(wal, timeline)
    if not archived:
        return None  # no archive: the base backup alone, which replays to its own end
    # Up to the end of the last segment archived: pg_waldump waits seconds for a missing file to appear.
    read = subprocess.run([str(BIN_DIR / "pg_waldump"), "--quiet", "--path", str(wal), "--timeline", str(timeline),
                           "--start", lsn, "--end", end_of(archived[-1], segment_bytes)],
                          user=user, cwd="/", capture_output=True, text=True, timeout=3600, check=False)
    error = " ".join(line.removeprefix("pg_waldump: error: ").strip() for line in read.stderr.splitlines()
                     if line.strip())
    if read.returncode == 0 or not error:
        return None
    named = QUOTED_SEGMENT.search(error)
    if "could not find file" in error and named is not None:
        name = named.group(1) or named.group(2)
        if name > archived[-1]:
            return None  # the segment after the last one archived: the end
        return Problem("missing", wal / name, f"the archive goes on to {archived[-1]}")
    if named is not None:
        name = named.group(1) or named.group(2)
    else:  # a record that does not check out: the segment of the last position named
        positions = LSN.findall(error)
        name = segment_of(positions[-1] if positions else lsn, timeline, segment_bytes)
    if "Permission denied" in error:
        return Problem("unreadable", wal / name, error)
    return Problem("corrupt", wal / name, f"pg_waldump: {error}")
