"""``chimes backup`` and ``chimes restore``: base backups of the embedded PostgreSQL and point-in-time
restore from them and the WAL archive that ``chimes up --backup-dir`` keeps (docs/operations.md)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import click

from chimes.cli.options import aware_time
from chimes.security.secrets import KEY_FILE_NAME
from chimes.settings import default_data_dir

backup_dir_option = click.option(
    "--backup-dir", envvar="CHIMES_BACKUP_DIR", show_envvar=True, type=click.Path(path_type=Path), required=True,
    help="The backup folder: base backups in base/, archived WAL in wal/ (chimes up --backup-dir fills it).")


@click.command()
@click.option("--data-dir", envvar="CHIMES_DATA_DIR", show_envvar=True, type=click.Path(path_type=Path),
              default=default_data_dir(), show_default=True, help="The data dir of the embedded PostgreSQL.")
@backup_dir_option
@click.option("--keep", type=click.IntRange(1), default=None,
              help="Then remove all but the KEEP newest base backups and the archived WAL only they needed "
                   "(default: remove nothing).")
def backup(data_dir: Path, backup_dir: Path, keep: int | None) -> None:
    """Take a base backup of the embedded PostgreSQL (running or not) into BACKUP_DIR/base."""
    from chimes.store.backup import BackupError, prune, take_base_backup

    try:
        made = take_base_backup(data_dir, backup_dir)
    except BackupError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"base backup {made.folder} ({made.started.isoformat()} to {made.finished.isoformat()}); it "
               f"restores to any time from {made.finished.isoformat()} on, as far as the archived WAL goes")
    if keep is not None:
        dropped, wal_files = prune(backup_dir, keep)
        click.echo(f"removed {len(dropped)} older base backups and {wal_files} archived WAL files")



@click.command()
@click.option("--from", "backup_dir", envvar="CHIMES_BACKUP_DIR", show_envvar=True, required=True,
              type=click.Path(path_type=Path, exists=True, file_okay=False), help="The backup folder.")
@click.option("--to-time", callback=aware_time, default=None,
              help="Restore the database as it was at this time (ISO 8601 with a zone). Default: the last "
                   "archived commit.")
@click.option("--data-dir", envvar="CHIMES_DATA_DIR", show_envvar=True, type=click.Path(path_type=Path),
              default=default_data_dir(), show_default=True, help="The data dir to restore into.")
@click.option("--force", is_flag=True,
              help="Restore over a data dir that is not empty: the present one is renamed aside, not deleted.")
def restore(backup_dir: Path, to_time: datetime | None, data_dir: Path, force: bool) -> None:
    """Restore the embedded database to a point in time from a base backup and the archived WAL.

    The data dir must not be in use. The base backup is verified first (pg_verifybackup). The restore
    replays into a hidden folder next to the data dir and moves it into place only when the server has
    reached the point: without --to-time, the end of the archived WAL; a segment missing, corrupt or unreadable
    before that end fails the restore, naming the file. A failure leaves the data dir as it was.
    """
    from chimes.store.backup import BackupError
    from chimes.store.backup import restore as restore_database

    try:
        done = restore_database(backup_dir, data_dir, to_time, force=force, key_file=KEY_FILE_NAME)
    except BackupError as exc:
        raise click.ClickException(str(exc)) from None
    if done.replaced is not None:
        click.echo(f"the data dir that was there is now {done.replaced}")
    click.echo(f"restored {done.data_dir} from base backup {done.backup.folder.name} in {done.seconds:.1f} s; "
               f"replay: {done.reached}")
    if not done.key_carried:
        click.echo(f"no secret key was in {done.data_dir}: put the key file the database's secrets were sealed with "
                   f"at {done.data_dir / 'secret.key'} (or set CHIMES_SECRET_KEY) before starting Chimes")
    click.echo("WAL archiving is off on the restored database: start chimes up with --backup-dir and take a "
               "new base backup (chimes backup) to protect it")
