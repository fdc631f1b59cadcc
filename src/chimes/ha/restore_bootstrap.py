"""Patroni's custom bootstrap for ``chimes ha restore``: put a verified base backup in place as the
new member's data directory.

Patroni runs ``python restore_bootstrap.py --scope=S --datadir=D --backup=B`` (``bootstrap.method``,
docs/high-availability.md), then writes the recovery settings of the method (``restore_command``,
``recovery_target_time``, ``recovery_target_action = promote``) and starts PostgreSQL, which replays
the archive up to the target and promotes; Patroni then makes it the leader. The standard library
only: this runs under the interpreter that runs Patroni, which need not have Chimes installed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

#: Files of the backup that must not reach the new data directory: the backup's own manifest, a
#: standby's signal files (Patroni writes the recovery settings itself), Patroni's cache of the old
#: cluster's dynamic configuration, and a server's pid and options.
LEFT_OUT = frozenset({"backup_manifest", "standby.signal", "recovery.signal", "patroni.dynamic.json",
                      "postmaster.pid", "postmaster.opts"})


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scope", help="the Patroni cluster's name (given by Patroni; unused)")
    parser.add_argument("--datadir", required=True, type=Path, help="the data directory to fill")
    parser.add_argument("--backup", required=True, type=Path, help="the base backup's data folder")
    args = parser.parse_args(argv)
    source: Path = args.backup
    target: Path = args.datadir
    if not (source / "PG_VERSION").is_file() or not (source / "backup_label").is_file():
        print(f"restore_bootstrap: {source} is no base backup (no PG_VERSION or backup_label)", file=sys.stderr)
        return 1
    if target.exists() and any(target.iterdir()):
        print(f"restore_bootstrap: {target} is not empty", file=sys.stderr)
        return 1

    def left_out(folder: str, names: list[str]) -> set[str]:
        return set(names) & LEFT_OUT if Path(folder) == source else set()

    shutil.copytree(source, target, symlinks=True, ignore=left_out, dirs_exist_ok=True)
    target.chmod(0o700)  # PostgreSQL refuses a data directory others may read
    print(f"restore_bootstrap: copied {source} into {target}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
