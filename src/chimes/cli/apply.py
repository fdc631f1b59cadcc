"""``chimes apply`` and ``chimes export``: a team's jobs kept in a file (YAML or JSON) in Git and
applied from CI, matched by name; the file format and the rules are in :mod:`chimes.cli.jobfile`.

Apply reads and validates the whole file and works out every change before it writes anything, so
a bad file changes nothing. It manages the jobs of the token's owner (``GET /whoami``) only, even
with an admin token that sees every team's. Each update and delete carries the version it was
computed from (If-Match): a job changed in between is refused, not overwritten.
"""

from __future__ import annotations

import json
from typing import IO, Any

import click

from chimes.cli import jobfile
from chimes.cli.client import ClientError, api_options, error_message
from chimes.client import ChimesError, Client, Job
from chimes.client.errors import NotFound

PAGE = 500
SYMBOLS = {"create": "create   ", "update": "update   ", "delete": "delete   ", "unchanged": "unchanged"}


def _owned_jobs(api: Client) -> tuple[str, list[Job]]:
    owner = api.whoami().owner
    return owner, [job for job in api.jobs.list(page_size=PAGE) if job.owner == owner]


@click.command("apply")
@api_options
@click.option("--file", "-f", "file", type=click.File("r"), required=True,
              help="The jobs file (YAML or JSON; '-' for stdin).")
@click.option("--dry-run", is_flag=True, help="Print what would change and change nothing.")
@click.option("--prune", is_flag=True, help="Also delete the owner's jobs that the file does not list.")
@click.option("--update-secrets", is_flag=True,
              help="Send the file's secret values even where nothing else in the task changed (to rotate them).")
def apply_jobs(api: Client, file: IO[str], dry_run: bool, prune: bool, update_secrets: bool) -> None:
    """Create or update the jobs a file describes, matched by name among the token owner's jobs.

    Applying the same file twice changes nothing the second time. Secret values are compared by name
    only (the API never shows them): ******** keeps the stored value, ${NAME} takes it from the
    environment.
    """
    source = getattr(file, "name", None) or "<stdin>"
    try:
        wanted = jobfile.load(file.read(), source)
        owner, current = _owned_jobs(api)
        if wanted.owner is not None and wanted.owner != owner:
            raise jobfile.JobFileError([f"{source}: owner: the file describes {wanted.owner!r}'s jobs, but this "
                                        f"token acts for {owner!r}"])
        changes = jobfile.plan(wanted, current, prune=prune, update_secrets=update_secrets, source=source)
    except jobfile.JobFileError as exc:
        raise ClientError(f"{exc}\nnothing was changed") from None
    calendar_changes = _calendar_changes(api, wanted.calendars)
    for name, action in calendar_changes:
        click.echo(f"{SYMBOLS[action]} calendar {name}")
    for change in changes:
        _print(change)
    counts = {action: sum(c.action == action for c in changes) for action in SYMBOLS}
    if dry_run:
        click.echo(f"dry run: {counts['create']} to create, {counts['update']} to update, {counts['delete']} to "
                   f"delete, {counts['unchanged']} unchanged; nothing was changed")
        return
    done = 0
    for name, action in calendar_changes:
        if action != "unchanged":
            try:
                api.calendars.put(name, wanted.calendars[name])
            except ChimesError as exc:
                raise ClientError(f"calendar {name}: {error_message(exc)}\nno job was changed") from None
    for change in changes:
        try:
            _make(api, change)
        except ChimesError as exc:
            raise ClientError(f"{change.action} {change.name}: {error_message(exc)}\n{done} changes were made "
                              "before this one; the rest were not") from None
        done += change.action != "unchanged"
    click.echo(f"applied: {counts['create']} created, {counts['update']} updated, {counts['delete']} deleted, "
               f"{counts['unchanged']} unchanged")


def _calendar_changes(api: Client, wanted: dict[str, dict[str, Any]]) -> list[tuple[str, jobfile.Action]]:
    """What applying the file's calendars would do to each: create, update, or nothing."""
    changes: list[tuple[str, jobfile.Action]] = []
    for name, calendar in wanted.items():
        try:
            current = api.calendars.get(name).raw
        except NotFound:
            changes.append((name, "create"))
            continue
        same = all(current.get(key) == value for key, value in calendar.items())
        changes.append((name, "unchanged" if same else "update"))
    return changes


def _print(change: jobfile.Change) -> None:
    job = f" (job {change.job_id})" if change.job_id and change.action != "unchanged" else ""
    paused = " (paused)" if change.pause else ""
    click.echo(f"{SYMBOLS[change.action]} {change.name}{job}{paused}")
    for line in change.diff:
        click.echo(f"    {line}")


def _make(api: Client, change: jobfile.Change) -> None:
    if change.action == "create":
        created = api.jobs.create(change.body)
        if change.pause:
            api.jobs.pause(created.job_id)
    elif change.action == "update" and change.job_id:
        api.jobs.update(change.job_id, change.body, if_version=change.version)
    elif change.action == "delete" and change.job_id:
        api.jobs.delete(change.job_id, if_version=change.version)


@click.command("export")
@api_options
@click.option("--output", "-o", type=click.Choice(["yaml", "json"]), default="yaml", show_default=True,
              help="The format; `chimes apply` takes both.")
@click.option("--file", "-f", "file", type=click.File("w"), default="-", help="Where to write (default stdout).")
def export_jobs(api: Client, output: str, file: IO[str]) -> None:
    """Write the token owner's jobs in the format `chimes apply -f` takes (secret values as ********)."""
    owner, jobs = _owned_jobs(api)
    document = jobfile.export(owner, jobs)
    if output == "json":
        file.write(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    else:
        file.write(jobfile.dump_yaml(document))
