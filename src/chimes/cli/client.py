"""``chimes jobs`` and ``chimes runs``: the REST API (API.md) from the command line.

Every subcommand takes ``--api-url`` (``CHIMES_API_URL``), ``--token`` (``CHIMES_TOKEN``) and
``--verbose`` (the HTTP requests and waits on stderr; without it a command prints only its answer);
read commands take ``--output json`` (or ``--json``) to print the API's answer as it came instead of a
table. Lists fit the terminal: in one narrower than 120 columns they show short ids (the last 8
characters, which every command taking a job id accepts) and relative times; ``--wide`` shows all.
Tables live in :mod:`chimes.cli.client_render`; every request goes through :class:`chimes.client.Client`
(rate limits, errors), and answers are printed from the API's JSON as it came (``.raw``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import IO, Any

import click
from pydantic import ValidationError
from rich.console import Console
from rich.live import Live

from chimes import cron, previews
from chimes.cli import client_render as render
from chimes.client import ApiError, ChimesError, Client
from chimes.client.asynchronous import DEFAULT_API_URL, RATE_LIMIT_RETRIES, RETRY_AFTER_CAP_SEC
from chimes.jobs import UNION_TAGS

__all__ = ["DEFAULT_API_URL", "RATE_LIMIT_RETRIES", "RETRY_AFTER_CAP_SEC", "jobs", "runs"]
log = logging.getLogger("chimes.cli")
RUN_STATUSES = ("scheduled", "running", "succeeded", "failed", "skipped", "cancelled")
_sleep = time.sleep  # replaced in tests
NO_TOKEN = ("no API token: pass --token or set CHIMES_TOKEN (`chimes up` prints an admin token on its "
            "first start; `chimes token create --owner TEAM` makes one)")


class ClientError(click.ClickException):
    """Shown as ``error: MESSAGE`` on stderr, exit status 1."""

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"error: {self.format_message()}", err=file is None, file=file)


def error_message(exc: ChimesError) -> str:
    """What the CLI says about a failed call: the API's message, with a hint for a bad token."""
    message = str(exc)
    if isinstance(exc, ApiError) and exc.status == 401:
        message += " (check --token / CHIMES_TOKEN)"
    return message


def open_client(api_url: str, token: str) -> Client:
    """The client every API command uses; it waits out rate limits with :data:`_sleep`."""
    return Client(api_url, token, sleep=lambda seconds: _sleep(seconds), user_agent="chimes-cli")


# Loggers that speak while a client command runs: the HTTP library's request lines and the CLI's own
# notes (waiting out a rate limit). Heard with --verbose only.
CLIENT_LOGGERS = ("httpx", "httpcore", "chimes.cli", "chimes.client")


@contextlib.contextmanager
def _client_logging(verbose: bool) -> Iterator[None]:
    """Quiet unless --verbose: a client command's output is what the user asked for, nothing else."""
    loggers = [logging.getLogger(name) for name in CLIENT_LOGGERS]
    before = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.DEBUG if verbose and logger.name.startswith("chimes.") else
                        logging.INFO if verbose else logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, before, strict=True):
            logger.setLevel(level)


def api_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add --api-url, --token and --verbose; the command gets an open :class:`~chimes.client.Client`
    as its first argument, and any :class:`~chimes.client.ChimesError` is shown as ``error: ...``."""

    @functools.wraps(func)
    def wrapper(*args: Any, api_url: str, token: str | None, verbose: bool, **kwargs: Any) -> Any:
        if not token:
            raise click.UsageError(NO_TOKEN)
        with _client_logging(verbose), open_client(api_url, token) as api:
            try:
                return func(api, *args, **kwargs)
            except ChimesError as exc:
                raise ClientError(error_message(exc)) from None

    wrapper = click.option("--verbose", "-v", is_flag=True,
                           help="Log each HTTP request (and any wait for a rate limit) on stderr.")(wrapper)
    wrapper = click.option("--token", envvar="CHIMES_TOKEN", show_envvar=True, default=None,
                           help="API token (required).")(wrapper)
    return click.option("--api-url", envvar="CHIMES_API_URL", show_envvar=True, default=DEFAULT_API_URL,
                        show_default=True, help="Base URL of the Chimes API.")(wrapper)


def json_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--output table|json`` (and ``--json``, the same as ``--output json``); the command gets ``as_json``."""

    @functools.wraps(func)
    def wrapper(*args: Any, output: str, json_flag: bool, **kwargs: Any) -> Any:
        return func(*args, as_json=json_flag or output == "json", **kwargs)

    wrapper = click.option("--json", "json_flag", is_flag=True, help="The same as --output json.")(wrapper)
    return click.option("--output", "-o", type=click.Choice(["table", "json"]), default="table", show_default=True,
                        help="json: the API's answer as it came, for scripts.")(wrapper)


wide_option = click.option("--wide", is_flag=True,
                           help="Whole ids and times, whatever the terminal's width (narrow ones get short ones).")


def _wide(flag: bool) -> bool:
    return flag or Console().width >= render.WIDE_COLUMNS


SHORT_ID_PATTERN = re.compile(r"[0-9a-fA-F]{4,12}")


def _job_id(api: Client, given: str) -> str:
    """A whole job id as given, or the one job of the caller's whose id ends with ``given`` (4 to 12
    hex characters, as narrow lists show them)."""
    if not SHORT_ID_PATTERN.fullmatch(given):
        return given
    found = [j.job_id for j in api.jobs.list(page_size=500) if j.job_id.lower().endswith(given.lower())]
    if len(found) == 1:
        return found[0]
    if not found:
        raise ClientError(f"no job of yours has an id ending in {given}")
    raise ClientError(f"{len(found)} jobs have an id ending in {given}: {', '.join(found[:5])}; give more of it")


def _run_id(api: Client, given: str, job: str | None) -> str:
    """A whole run id as given, or the one run of ``job`` (its 500 newest) whose id ends with ``given``."""
    if not SHORT_ID_PATTERN.fullmatch(given):
        return given
    if job is None:
        raise click.UsageError(f"{given} is a short run id: give --job JOB_ID too (the job whose runs list "
                               "showed it), or the whole id (`chimes runs list JOB_ID --wide`)")
    page = api.runs.page(_job_id(api, job), limit=500)
    found = [r.run_id for r in page.items if r.run_id.lower().endswith(given.lower())]
    if len(found) != 1:
        raise ClientError(f"{len(found) or 'no'} runs of job {job} have an id ending in {given}")
    return found[0]


job_of_run_option = click.option("--job", "job", metavar="JOB_ID", help="The run's job, to take a short run id.")


def _show(renderable: Any) -> None:
    Console().print(renderable)


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2))


def _read_json(file: IO[str], option: str) -> dict[str, Any]:
    try:
        data = json.load(file)
    except ValueError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}", param_hint=option) from None
    if not isinstance(data, dict):
        raise click.BadParameter("must hold a JSON object", param_hint=option)
    return data


# ----------------------------------------------------------------------------------------------- jobs


@click.group()
def jobs() -> None:
    """Create, list, change and trigger jobs through the API."""


# The bounds every recurring schedule may have (chimes.jobs._RecurringScheduleSpec): each option's
# name and the field of the schedule it sets. A bound added here is sent, refused with --at, and kept
# when an update changes the rule.
BOUND_OPTIONS = {"start_at": "startAt", "end_at": "endAt", "max_runs": "maxRuns",
                 "exclude_calendars": "excludeCalendars"}
RULE_OPTIONS = ("cron", "timezone", "every", "phase")  # the options of a recurring schedule's rule


def _schedule_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed([
        click.option("--name", help="Job name."),
        click.option("--cron", help="Cron expression (5 fields, 6 with seconds, or @daily etc.)."),
        click.option("--timezone", help="IANA timezone of --cron (default UTC)."),
        click.option("--every", help="Interval schedule: fire every DURATION (90m, 1h30m, 45s, 2d), counted "
                                     "from the Unix epoch, so fires never drift."),
        click.option("--phase", help="With --every: how far past each multiple of the interval it fires "
                                     "(--every 90m --phase 15m fires at 00:15, 01:45, 03:15 UTC ...)."),
        click.option("--start-at", help="Recurring schedule: no fire before this time (RFC 3339 with an offset)."),
        click.option("--end-at", help="Recurring schedule: no fire after this time (RFC 3339 with an offset)."),
        click.option("--max-runs", type=click.IntRange(1), help="Recurring schedule: stop after this many slots."),
        click.option("--exclude-calendar", "exclude_calendars", multiple=True,
                     help="Recurring schedule: skip the days and windows of this calendar (repeatable)."),
        click.option("--at", help="One-off run time, RFC 3339 with an offset, e.g. 2026-12-01T09:00:00Z."),
        click.option("--max-attempts", type=click.IntRange(1, 100), help="Attempts before the run fails."),
        click.option("--timeout", type=click.IntRange(1), help="Seconds an attempt may take."),
        click.option("--concurrency", type=click.Choice(["skip", "queue", "allow", "replace"]),
                     help="What to do when a run is due while the last one still runs."),
        click.option("--priority", type=click.Choice(["high", "normal", "batch"]), help="Queue tier."),
        click.option("--catch-up", type=click.Choice(["one", "all", "none"]),
                     help="What happens to fires missed while the scheduler was down or the job paused."),
        click.option("--tag", "tags", multiple=True, help="A tag, for fleet-wide caps (repeatable)."),
        click.option("--notify-url", help="Webhook told when a run fails for good, starts late or stalls."),
        click.option("--pause-after-failures", type=click.IntRange(1, 1000),
                     help="Pause the job when this many consecutive runs failed for good."),
        click.option("--notify-on", "notify_on", multiple=True, type=click.Choice(["failed", "succeeded", "started"]),
                     help="Run events the webhook is told of (repeatable; default: failed)."),
        click.option("--delete-after-completion", is_flag=True, default=None,
                     help="One-off (--at) jobs: delete the job once its run ended for good (its runs stay)."),
    ]):
        func = option(func)
    return func


@jobs.command("create")
@api_options
@_schedule_options
@click.option("--url", help="HTTP task: the URL to call (a 2xx answer is success).")
@click.option("--method", type=click.Choice(["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
                                            case_sensitive=False), help="HTTP task method (default POST).")
@click.option("--header", "headers", multiple=True, metavar="'K: V'", help="HTTP task header (repeatable).")
@click.option("--body", help="HTTP task body, as JSON.")
@click.option("--command", help="Command task: a shell-quoted command line (run without a shell).")
@click.option("--file", type=click.File("r"), help="A whole POST /jobs body as JSON ('-' for stdin).")
@click.option("--idempotency-key", help="Makes the create safe to retry: the same key returns the same job.")
def create(api: Client, file: IO[str] | None, idempotency_key: str | None, **opts: Any) -> None:
    """Create a job: --name, --cron or --at, and --url or --command; or --file job.json."""
    if file is not None:
        given = [f"--{k.replace('_', '-')}" for k, v in opts.items() if v not in (None, ())]
        if given:
            raise click.UsageError(f"--file cannot be combined with {', '.join(given)}; put them in the file")
        definition = _read_json(file, "--file")
    else:
        definition = _definition(opts)
    created = api.jobs.create(definition, idempotency_key=idempotency_key)
    click.echo(f"created job {created.job_id}")
    click.echo(f"next run: {render.when(created.next_run_at) or 'none'}")


def _definition(opts: dict[str, Any]) -> dict[str, Any]:
    if not opts["name"]:
        raise click.UsageError("give --name (or a whole job with --file)")
    definition: dict[str, Any] = {"name": opts["name"], "schedule": _new_schedule(opts), "task": _task(opts)}
    return definition | _tuning(opts)


def _new_schedule(opts: dict[str, Any]) -> dict[str, Any]:
    if bool(opts["cron"]) + bool(opts["every"]) + bool(opts["at"]) != 1:
        raise click.UsageError("give exactly one of --cron or --every (recurring) or --at (one-off)")
    _check_schedule_options(opts)
    if opts["at"]:
        if any(opts[key] for key in BOUND_OPTIONS):
            raise click.UsageError("--start-at, --end-at, --max-runs and --exclude-calendar go with --cron or --every")
        return {"at": opts["at"]}
    if opts["every"]:
        schedule = {"every": opts["every"]} | ({"phase": opts["phase"]} if opts["phase"] else {})
    else:
        schedule = {"cron": opts["cron"], "timezone": opts["timezone"] or "UTC"}
    return schedule | _bounds(opts)


def _check_schedule_options(opts: dict[str, Any]) -> None:
    if opts["timezone"] and (opts["at"] or opts["every"]):
        raise click.UsageError("--timezone goes with --cron (an interval counts elapsed time; give --at with "
                               "an offset instead)")
    if opts["phase"] and not opts["every"]:
        raise click.UsageError("--phase goes with --every")


def _bounds(opts: dict[str, Any]) -> dict[str, Any]:
    given = {field: opts[key] for key, field in BOUND_OPTIONS.items()}
    return {key: list(value) if isinstance(value, tuple) else value for key, value in given.items() if value}


def _task(opts: dict[str, Any]) -> dict[str, Any]:
    if bool(opts["url"]) == bool(opts["command"]):
        raise click.UsageError("give exactly one of --url (HTTP task) or --command (command task)")
    if opts["command"]:
        if opts["method"] or opts["headers"] or opts["body"] is not None:
            raise click.UsageError("--method, --header and --body go with --url")
        try:
            argv = shlex.split(opts["command"])
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--command") from None
        if not argv:
            raise click.BadParameter("is empty", param_hint="--command")
        return {"type": "command", "argv": argv}
    task: dict[str, Any] = {"type": "http", "method": (opts["method"] or "POST").upper(), "url": opts["url"]}
    if opts["headers"]:
        task["headers"] = dict(_header(h) for h in opts["headers"])
    if opts["body"] is not None:
        try:
            task["body"] = json.loads(opts["body"])
        except ValueError as exc:
            raise click.BadParameter(f"not valid JSON: {exc}", param_hint="--body") from None
    return task


def _header(text: str) -> tuple[str, str]:
    name, colon, value = text.partition(":")
    if not colon or not name.strip():
        raise click.BadParameter(f"{text!r} is not 'Name: value'", param_hint="--header")
    return name.strip(), value.strip()


def _tuning(opts: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if opts["max_attempts"] is not None:
        out["retryPolicy"] = {"maxAttempts": opts["max_attempts"]}
    if opts["timeout"] is not None:
        out["timeoutSec"] = opts["timeout"]
    for key in ("concurrency", "priority"):
        if opts[key]:
            out[key] = opts[key]
    if opts.get("catch_up"):
        out["catchUp"] = {"policy": opts["catch_up"]}
    if opts.get("tags"):
        out["tags"] = list(opts["tags"])
    if opts.get("notify_url"):
        out["notifyUrl"] = opts["notify_url"]
    if opts.get("pause_after_failures"):
        out["pauseAfterFailures"] = opts["pause_after_failures"]
    if opts.get("notify_on"):
        out["notifyOn"] = list(opts["notify_on"])
    if opts.get("delete_after_completion"):
        out["deleteAfterCompletion"] = True
    return out


@jobs.command("list")
@api_options
@click.option("--limit", type=click.IntRange(1, 500), help="Jobs per page (the API's default is 50).")
@click.option("--all", "follow", is_flag=True, help="Follow nextCursor and list every job.")
@click.option("--tag", help="Only jobs with this tag.")
@click.option("--name-prefix", help="Only jobs whose name starts with this (case-sensitive).")
@click.option("--paused/--active", "paused", default=None, help="Only paused jobs, or only active ones.")
@click.option("--kind", type=click.Choice(["cron", "interval", "at"]),
              help="Only jobs on a cron schedule, on an interval, or one-off (at).")
@json_option
@wide_option
def list_jobs(api: Client, limit: int | None, follow: bool, tag: str | None, name_prefix: str | None,
              paused: bool | None, kind: str | None, as_json: bool, wide: bool) -> None:
    """List your jobs (short ids and relative times in a terminal under 120 columns); the API filters."""
    where: dict[str, Any] = {"tag": tag, "name_prefix": name_prefix, "paused": paused, "kind": kind}
    if follow:
        listed, cursor = list(api.jobs.list(page_size=limit, **where)), None
    else:
        page = api.jobs.page(limit=limit, **where)
        listed, cursor = page.items, page.next_cursor
    items = [job.raw for job in listed]
    if as_json:
        _echo_json({"jobs": items, "nextCursor": cursor})
        return
    _show(render.jobs_table(items, wide=_wide(wide)))
    if cursor:
        click.echo("more jobs: pass --all to list them all", err=True)


@jobs.command("get")
@api_options
@click.argument("job_id")
@click.option("--next", "-n", "preview", type=click.IntRange(1, previews.MAX_PREVIEW),
              help="Also show the next N fire times, as the scheduler fires them (DST policy, jitter, bounds).")
@json_option
def get_job(api: Client, job_id: str, preview: int | None, as_json: bool) -> None:
    """Show one job and its definition."""
    job = api.jobs.get(_job_id(api, job_id), preview=preview).raw
    if as_json:
        _echo_json(job)
    else:
        _show(render.job_detail(job))


@jobs.command("pause")
@api_options
@click.argument("job_id")
@click.option("--note", help="Why the job is paused (shown with the job and in its pause history).")
def pause(api: Client, job_id: str, note: str | None) -> None:
    """Pause a job: no runs fire until it is resumed."""
    job_id = _job_id(api, job_id)
    job = api.jobs.pause(job_id, note)
    click.echo(f"paused job {job_id} (paused by {job.paused_by}{': ' + job.pause_note if job.pause_note else ''})")


@jobs.command("pauses")
@api_options
@click.argument("job_id")
@json_option
def pauses(api: Client, job_id: str, as_json: bool) -> None:
    """A job's pauses, newest first: who paused it, why, and who resumed it."""
    found = api.jobs.pauses(_job_id(api, job_id))
    if as_json:
        _echo_json({"pauses": [p.raw for p in found]})
        return
    for p in found:
        resumed = f"; resumed {render.when(p.resumed_at)} by {p.resumed_by}" if p.resumed_at else "; still paused"
        click.echo(f"paused {render.when(p.paused_at)} by {p.paused_by}{': ' + p.note if p.note else ''}{resumed}")


@jobs.command("resume")
@api_options
@click.argument("job_id")
def resume(api: Client, job_id: str) -> None:
    """Resume a paused job."""
    job_id = _job_id(api, job_id)
    job = api.jobs.resume(job_id)
    click.echo(f"resumed job {job_id}; next run: {render.when(job.next_run_at) or 'none'}")


@jobs.command("update")
@api_options
@_schedule_options
@click.option("--file", type=click.File("r"),
              help="A PATCH body as JSON ('-' for stdin); options override it.")
@click.argument("job_id")
def update(api: Client, job_id: str, file: IO[str] | None, **opts: Any) -> None:
    """Change a job; fields not given stay as they are."""
    job_id = _job_id(api, job_id)
    patch = _read_json(file, "--file") if file is not None else {}
    current: dict[str, Any] = {}

    def job() -> dict[str, Any]:
        if not current:
            current.update(api.jobs.get(job_id).raw)
        return current

    if opts["name"]:
        patch["name"] = opts["name"]
    if any(opts[key] for key in ("at", *RULE_OPTIONS, *BOUND_OPTIONS)):
        patch["schedule"] = _changed_schedule(opts, job)
    tuning = _tuning(opts)
    if "retryPolicy" in tuning:
        tuning["retryPolicy"] = {**(job().get("retryPolicy") or {}), **tuning["retryPolicy"]}
    patch |= tuning
    if not patch:
        raise click.UsageError("nothing to change: give at least one option or --file")
    # The version the patch was computed from goes as If-Match: a change made in between is refused
    # (412) rather than overwritten. A patch that read nothing needs none.
    updated = api.jobs.update(job_id, patch, if_version=current.get("version"))
    click.echo(f"updated job {job_id} (version {updated.version}); "
               f"next run: {render.when(updated.next_run_at) or 'none'}")


def _changed_schedule(opts: dict[str, Any], job: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The job's schedule with the options given applied; a new rule (--cron, --every) keeps the
    jitter and the bounds of a recurring one."""
    if opts["cron"] and opts["every"]:
        raise click.UsageError("give either --cron or --every")
    if opts["at"]:
        if any(opts[key] for key in (*RULE_OPTIONS, *BOUND_OPTIONS)):
            raise click.UsageError("give either --at or a recurring schedule (--cron/--every)")
        return {"at": opts["at"]}
    schedule = job().get("schedule") or {}
    if "at" in schedule and not (opts["cron"] or opts["every"]):
        raise click.UsageError("this job runs once (--at); give --cron or --every to make it recurring")
    kept = {k: v for k, v in schedule.items() if k == "jitterSec" or k in BOUND_OPTIONS.values()}
    if opts["every"] or ("everySec" in schedule and not opts["cron"]):
        if opts["timezone"]:
            raise click.UsageError("--timezone goes with --cron: an interval counts elapsed time")
        rule: dict[str, Any] = ({"every": opts["every"]} if opts["every"]
                                else {"everySec": schedule["everySec"], "phaseSec": schedule.get("phaseSec", 0)})
        if opts["phase"]:
            rule = {k: v for k, v in rule.items() if k != "phaseSec"} | {"phase": opts["phase"]}
    else:
        if opts["phase"]:
            raise click.UsageError("--phase goes with an interval schedule (--every)")
        same = {k: v for k, v in schedule.items() if k in ("cron", "timezone", "dstGap", "dstFold")}
        rule = same | {"cron": opts["cron"] or schedule["cron"],
                       "timezone": opts["timezone"] or schedule.get("timezone") or "UTC"}
    return rule | kept | _bounds(opts)


@jobs.command("delete")
@api_options
@click.argument("job_id")
def delete(api: Client, job_id: str) -> None:
    """Delete a job (its run history stays listable with `chimes runs list JOB_ID`)."""
    job_id = _job_id(api, job_id)
    api.jobs.delete(job_id)
    click.echo(f"deleted job {job_id}")


@jobs.command("run")
@api_options
@click.argument("job_id")
def run_now(api: Client, job_id: str) -> None:
    """Trigger a manual run now; prints the run id."""
    click.echo(f"started run {api.jobs.run_now(_job_id(api, job_id))}")


@jobs.command("backfill")
@api_options
@click.argument("job_id")
@click.option("--start", required=True, help="Start of the past range (exclusive), RFC 3339 with an offset.")
@click.option("--end", required=True, help="End of the past range (inclusive), RFC 3339 with an offset.")
def backfill(api: Client, job_id: str, start: str, end: str) -> None:
    """Create the runs the schedule would have made in a past range (at most 1,000; slots that
    already have a run keep it, slots the job's calendars exclude are recorded as skipped)."""
    made = api.jobs.backfill(_job_id(api, job_id), start, end)
    skipped = f"; {made.skipped} skipped (excluded by a calendar)" if made.skipped else ""
    click.echo(f"created {made.created} runs; {made.existing} slots already had one{skipped}")


# ----------------------------------------------------------------------------------------------- runs


@click.group()
def runs() -> None:
    """Inspect, rerun, cancel and watch runs through the API."""


status_option = click.option("--status", type=click.Choice(RUN_STATUSES), help="Only runs in this status.")
limit_option = click.option("--limit", type=click.IntRange(1, 500),
                            help="Runs to show (the API's default is 50).")


@runs.command("list")
@api_options
@click.argument("job_id")
@status_option
@limit_option
@json_option
@wide_option
def list_runs(api: Client, job_id: str, status: str | None, limit: int | None, as_json: bool, wide: bool) -> None:
    """List a job's runs, newest scheduled time first (also a deleted job's, until retention)."""
    page = api.runs.page(_job_id(api, job_id), status=status, limit=limit)
    if as_json:
        _echo_json(page.raw)
        return
    _show(render.runs_table([run.raw for run in page.items], wide=_wide(wide)))
    if page.job_deleted:
        click.echo("this job was deleted; its runs stay until retention removes them", err=True)
    if page.next_cursor:
        click.echo("more runs: pass a larger --limit to see them", err=True)


@runs.command("get")
@api_options
@click.argument("run_id")
@job_of_run_option
@json_option
def get_run(api: Client, run_id: str, job: str | None, as_json: bool) -> None:
    """Show a run, its attempts and the last attempt's output."""
    run = api.runs.get(_run_id(api, run_id, job)).raw
    if as_json:
        _echo_json(run)
    else:
        _show(render.run_detail(run))


@runs.command("rerun")
@api_options
@click.argument("run_id")
@job_of_run_option
def rerun(api: Client, run_id: str, job: str | None) -> None:
    """Run that run's job again now, as a new run."""
    click.echo(f"started run {api.runs.rerun(_run_id(api, run_id, job))}")


@runs.command("cancel")
@api_options
@click.argument("run_id")
@job_of_run_option
def cancel(api: Client, run_id: str, job: str | None) -> None:
    """Cancel a run that has not finished."""
    run = api.runs.cancel(_run_id(api, run_id, job))
    click.echo(f"run {run_id}: {run.status}")


FINAL_RUN_STATUSES = frozenset({"succeeded", "failed", "skipped", "cancelled"})


@runs.command("watch")
@api_options
@click.argument("job_id")
@click.option("--interval", type=click.FloatRange(0.1), default=1.0, show_default=True,
              help="Seconds between refreshes.")
@click.option("--until-done", is_flag=True,
              help="Stop once every run seen has ended (succeeded, failed, skipped or cancelled).")
@status_option
@limit_option
@wide_option
def watch(api: Client, job_id: str, interval: float, until_done: bool, status: str | None, limit: int | None,
          wide: bool) -> None:
    """Show a job's runs, refreshed every --interval seconds, until Ctrl-C (or --until-done).

    On a terminal the table is redrawn in place; otherwise (a pipe, a file, a CI log) each run is
    printed as one line when it first appears and again whenever it changes."""
    try:
        with _CtrlC() as ctrl_c:
            job_id = _job_id(api, job_id)

            def fetch() -> list[dict[str, Any]]:
                return [run.raw for run in api.runs.page(job_id, status=status, limit=limit).items]

            if Console().is_terminal:
                _watch_live(job_id, fetch, interval, until_done, wide, ctrl_c)
            else:
                _watch_lines(fetch, interval, until_done, ctrl_c)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # `| head` stopped reading: that is the reader's way to say stop
        _silence_stdout()


class _CtrlC:
    """Ctrl-C (SIGINT) for `runs watch`. While the command waits between refreshes it stops at once;
    pressed during a request it is noted, and the watch stops as that request ends. A
    KeyboardInterrupt raised mid-request lands anywhere inside the blocking client's wait on its
    loop's thread (chimes.client.blocking), a lock's acquire or release included; now and then the
    command then failed to exit at all (tests/integration/test_runs_watch.py, once in many runs)."""

    def __init__(self) -> None:
        self.pressed = False
        self._napping = False
        self._previous: Any = None

    def __enter__(self) -> _CtrlC:
        if threading.current_thread() is threading.main_thread():  # only there can a handler be set
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _on_sigint(self, _signum: int, _frame: object) -> None:
        self.pressed = True
        if self._napping:
            raise KeyboardInterrupt  # out of the sleep at once: nothing is held there

    def nap(self, seconds: float) -> None:
        """Sleep between refreshes; Ctrl-C ends it early, or skips it when pressed already."""
        if self.pressed:
            return
        self._napping = True
        try:
            _sleep(seconds)
        except KeyboardInterrupt:
            self.pressed = True
        finally:
            self._napping = False


def _all_ended(runs: list[dict[str, Any]]) -> bool:
    return bool(runs) and all(run.get("status") in FINAL_RUN_STATUSES for run in runs)


def _watch_live(job_id: str, fetch: Callable[[], list[dict[str, Any]]], interval: float, until_done: bool,
                wide: bool, ctrl_c: _CtrlC) -> None:
    def table(runs: list[dict[str, Any]]) -> Any:
        title = f"runs of job {job_id} at {time.strftime('%H:%M:%SZ', time.gmtime())} (Ctrl-C to stop)"
        return render.runs_table(runs, title=title, wide=_wide(wide))

    runs = fetch()
    with Live(table(runs), console=Console(), auto_refresh=False) as live:
        while not (until_done and _all_ended(runs)):
            ctrl_c.nap(interval)
            if ctrl_c.pressed:
                return
            runs = fetch()
            live.update(table(runs), refresh=True)


def _watch_lines(fetch: Callable[[], list[dict[str, Any]]], interval: float, until_done: bool,
                 ctrl_c: _CtrlC) -> None:
    """One line per run when it appears or changes, oldest first, like ``kubectl get -w``."""
    shown: dict[str, str] = {}
    while not ctrl_c.pressed:
        runs = fetch()
        for run in reversed(runs):  # the API lists newest first; a log reads oldest first
            line = render.run_line(run)
            if shown.get(run.get("runId", "")) != line:
                shown[run.get("runId", "")] = line
                click.echo(line)
        if until_done and _all_ended(runs):
            return
        ctrl_c.nap(interval)


def _silence_stdout() -> None:
    # Python flushes stdout again at exit and would report the broken pipe there.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


# ------------------------------------------------------------------------------------------ schedules


@click.group("cron")
def cron_group() -> None:
    """Check schedules before making jobs of them (computed here, by the scheduler's own rules)."""


@cron_group.command("next")
@click.argument("expression", required=False)
@click.option("--timezone", help="IANA time zone of EXPRESSION (default UTC).")
@click.option("--every", help="An interval schedule instead of EXPRESSION: every DURATION (90m, 1h30m, 45s).")
@click.option("--phase", help="With --every: how far past each multiple of the interval it fires.")
@click.option("--dst-gap", type=click.Choice(["shift", "skip"]), help="A cron time in a spring-forward gap.")
@click.option("--dst-fold", type=click.Choice(["first", "last", "both"]), help="A cron time in a fall-back fold.")
@click.option("--start-at", help="No fire before this time (RFC 3339 with an offset).")
@click.option("--end-at", help="No fire after this time (RFC 3339 with an offset).")
@click.option("--after", help="List fires after this time (RFC 3339 with an offset; default now).")
@click.option("-n", "count", type=click.IntRange(1, previews.MAX_PREVIEW), default=10, show_default=True,
              help="How many fire times.")
def cron_next(expression: str | None, count: int, **opts: Any) -> None:
    """The next fire times of a cron EXPRESSION (or of --every), in UTC and in the schedule's zone.

    \b
    chimes cron next '30 2 * * *' --timezone America/New_York -n 5
    chimes cron next --every 90m --phase 15m
    """
    if bool(expression) == bool(opts["every"]):
        raise click.UsageError("give exactly one of EXPRESSION or --every")
    schedule: dict[str, Any] = ({"cron": expression, "timezone": opts["timezone"] or "UTC"} if expression
                                else {"every": opts["every"]})
    given = {"phase": opts["phase"], "dstGap": opts["dst_gap"], "dstFold": opts["dst_fold"],
             "startAt": opts["start_at"], "endAt": opts["end_at"]}
    schedule |= {key: value for key, value in given.items() if value}
    try:
        parsed = previews.parse_schedule(schedule)
        after = datetime.fromisoformat(opts["after"]) if opts["after"] else datetime.now(UTC)
    except (ValidationError, ValueError) as exc:
        raise click.BadParameter(_first_problem(exc)) from None
    if after.tzinfo is None:
        raise click.BadParameter("--after needs an offset, e.g. 2026-12-01T09:00:00Z")
    zone = cron.parse_timezone(opts["timezone"] or "UTC")
    fires = previews.fires_after(parsed, None, after, count)
    for fire in fires:
        local = fire.astimezone(zone)
        click.echo(f"{fire.isoformat().replace('+00:00', 'Z')}  {local.strftime('%a %Y-%m-%d %H:%M:%S %Z')}")
    if not fires:
        click.echo("no fires: the schedule ends before that")


def _first_problem(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        error = exc.errors()[0]
        loc = error["loc"][1:] if error["loc"] and error["loc"][0] in UNION_TAGS["schedule"] else error["loc"]
        where = ".".join(str(part) for part in loc)
        return f"{where}: {error['msg'].removeprefix('Value error, ')}" if where else error["msg"]
    return str(exc)


# ------------------------------------------------------------------------------------------ calendars


@click.group("calendars")
def calendars() -> None:
    """Exclusion calendars: days and windows that jobs naming them in schedule.excludeCalendars skip."""


@calendars.command("put")
@api_options
@click.argument("name")
@click.option("--timezone", help="IANA time zone the dates are days in (default UTC).")
@click.option("--date", "dates", multiple=True, metavar="YYYY-MM-DD", help="An excluded day (repeatable).")
@click.option("--window", "windows", multiple=True, metavar="START/END",
              help="An excluded time range, RFC 3339 times with offsets, e.g. "
                   "2026-12-20T00:00:00Z/2027-01-04T00:00:00Z (repeatable).")
@click.option("--file", type=click.File("r"), help="The whole calendar as JSON ('-' for stdin).")
def put_calendar(api: Client, name: str, timezone: str | None, dates: tuple[str, ...], windows: tuple[str, ...],
                 file: IO[str] | None) -> None:
    """Create or replace the calendar NAME (it replaces all its days and windows)."""
    if file is not None:
        if timezone or dates or windows:
            raise click.UsageError("--file cannot be combined with --timezone, --date or --window")
        body = _read_json(file, "--file")
    else:
        body = {"timezone": timezone or "UTC", "dates": list(dates), "windows": [_window(w) for w in windows]}
    calendar = api.calendars.put(name, body)
    click.echo(f"calendar {calendar.name}: {len(calendar.dates)} days, {len(calendar.windows)} windows "
               f"({calendar.timezone}), version {calendar.version}")


def _window(text: str) -> dict[str, str]:
    start, slash, end = text.partition("/")
    if not slash or not start or not end:
        raise click.BadParameter(f"{text!r} is not START/END", param_hint="--window")
    return {"start": start, "end": end}


@calendars.command("get")
@api_options
@click.argument("name")
def get_calendar(api: Client, name: str) -> None:
    """Show the calendar NAME as JSON."""
    _echo_json(api.calendars.get(name).raw)


@calendars.command("list")
@api_options
def list_calendars(api: Client) -> None:
    """The caller's calendars."""
    for calendar in api.calendars.list():
        click.echo(f"{calendar.name}\t{calendar.timezone}\t{len(calendar.dates)} days\t"
                   f"{len(calendar.windows)} windows\tversion {calendar.version}")


@calendars.command("delete")
@api_options
@click.argument("name")
def delete_calendar(api: Client, name: str) -> None:
    """Delete the calendar NAME (refused while jobs name it)."""
    api.calendars.delete(name)
    click.echo(f"deleted calendar {name}")
