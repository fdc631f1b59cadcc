"""``chimes jobs`` and ``chimes runs``: the REST API (API.md) from the command line.

Every subcommand takes ``--api-url`` (``CHIMES_API_URL``), ``--token`` (``CHIMES_TOKEN``) and
``--verbose`` (the HTTP requests and waits on stderr; without it a command prints only its answer);
read commands take ``--output json`` (or ``--json``) to print the API's answer as it came instead of a
table. Lists fit the terminal: in one narrower than 120 columns they show short ids (the last 8
characters, which every command taking a job id accepts) and relative times; ``--wide`` shows all.
Tables live in :mod:`chimes.cli.client_render`.
"""

from __future__ import annotations

import contextlib
import email.utils
import functools
import json
import logging
import re
import shlex
import time
from collections.abc import Callable, Iterator
from typing import IO, Any
from urllib.parse import quote

import click
import httpx
from rich.console import Console
from rich.live import Live

from chimes.cli import client_render as render

DEFAULT_API_URL = "http://127.0.0.1:8080"
TIMEOUT_SEC = 30.0
RATE_LIMIT_RETRIES = 10      # 429s with Retry-After waited out per request before giving up
RETRY_AFTER_CAP_SEC = 60.0   # the longest single wait, whatever Retry-After says
log = logging.getLogger("chimes.cli")
RUN_STATUSES = ("scheduled", "running", "succeeded", "failed", "skipped", "cancelled")
_sleep = time.sleep  # replaced in tests
NO_TOKEN = ("no API token: pass --token or set CHIMES_TOKEN (`chimes up` prints an admin token on its "
            "first start; `chimes token create --owner TEAM` makes one)")


class ClientError(click.ClickException):
    """Shown as ``error: MESSAGE`` on stderr, exit status 1."""

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(f"error: {self.format_message()}", err=file is None, file=file)


class Api:
    """A small synchronous client: JSON in, JSON out, every failure a :class:`ClientError`."""

    def __init__(self, base_url: str, token: str) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=TIMEOUT_SEC,
                                  headers={"Authorization": f"Bearer {token}", "User-Agent": "chimes-cli"})

    def __enter__(self) -> Api:
        return self

    def __exit__(self, *_: object) -> None:
        self._http.close()

    def call(self, method: str, path: str, *, body: Any = None, params: dict[str, Any] | None = None,
             headers: dict[str, str] | None = None) -> Any:
        query = {k: v for k, v in (params or {}).items() if v is not None}
        response = self._send(method, path, body, query, headers)
        for _ in range(RATE_LIMIT_RETRIES):
            # A 429 with Retry-After was refused before anything was done (a rate limit), so the same
            # request is safe to send again once the wait is over, even a POST.
            wait = retry_after(response)
            if wait is None:
                break
            log.info("the API limits this token's requests; retrying in %.1f s", wait)
            _sleep(wait)
            response = self._send(method, path, body, query, headers)
        if response.status_code >= 400:
            raise ClientError(_error_message(response))
        if response.status_code == 204 or not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            status = response.status_code
            raise ClientError(f"the API answered {status} with a body that is not JSON") from None

    def _send(self, method: str, path: str, body: Any, query: dict[str, Any],
              headers: dict[str, str] | None) -> httpx.Response:
        try:
            return self._http.request(method, path, json=body, params=query, headers=headers)
        except httpx.ConnectError:
            raise ClientError(
                f"cannot reach the Chimes API at {self.base_url}: is `chimes up` (or `chimes api`) running?"
            ) from None
        except httpx.TimeoutException:
            raise ClientError(
                f"the Chimes API at {self.base_url} did not answer in {TIMEOUT_SEC:.0f}s"
            ) from None
        except httpx.HTTPError as exc:
            raise ClientError(f"request to {self.base_url} failed: {exc}") from None


def retry_after(response: httpx.Response) -> float | None:
    """Seconds to wait before sending a refused request again: from a 429's ``Retry-After``
    (seconds or an HTTP date), at most RETRY_AFTER_CAP_SEC; None when the answer is not one to
    retry (any other status, or a 429 without Retry-After, such as a full job quota)."""
    value = response.headers.get("Retry-After")
    if response.status_code != 429 or value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return None
    return min(max(seconds, 0.0), RETRY_AFTER_CAP_SEC)


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and (body.get("message") or body.get("error")):
        message = str(body.get("message") or body.get("error"))
    else:
        message = f"HTTP {response.status_code}: {response.text.strip()[:200] or response.reason_phrase}"
    if response.status_code == 401:
        message += " (check --token / CHIMES_TOKEN)"
    return message


# Loggers that speak while a client command runs: the HTTP library's request lines and the CLI's own
# notes (waiting out a rate limit). Heard with --verbose only.
CLIENT_LOGGERS = ("httpx", "httpcore", "chimes.cli")


@contextlib.contextmanager
def _client_logging(verbose: bool) -> Iterator[None]:
    """Quiet unless --verbose: a client command's output is what the user asked for, nothing else."""
    loggers = [logging.getLogger(name) for name in CLIENT_LOGGERS]
    before = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.DEBUG if verbose and logger.name == "chimes.cli" else
                        logging.INFO if verbose else logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, before, strict=True):
            logger.setLevel(level)


def api_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add --api-url, --token and --verbose; the command gets an open :class:`Api` as its first argument."""

    @functools.wraps(func)
    def wrapper(*args: Any, api_url: str, token: str | None, verbose: bool, **kwargs: Any) -> Any:
        if not token:
            raise click.UsageError(NO_TOKEN)
        with _client_logging(verbose), Api(api_url, token) as api:
            return func(api, *args, **kwargs)

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


def _job_id(api: Api, given: str) -> str:
    """A whole job id as given, or the one job of the caller's whose id ends with ``given`` (4 to 12
    hex characters, as narrow lists show them)."""
    if not SHORT_ID_PATTERN.fullmatch(given):
        return given
    jobs, _ = _pages(api, "/jobs", "jobs", {"limit": 500}, follow=True)
    found = [str(j["jobId"]) for j in jobs if str(j.get("jobId", "")).lower().endswith(given.lower())]
    if len(found) == 1:
        return found[0]
    if not found:
        raise ClientError(f"no job of yours has an id ending in {given}")
    raise ClientError(f"{len(found)} jobs have an id ending in {given}: {', '.join(found[:5])}; give more of it")


def _run_id(api: Api, given: str, job: str | None) -> str:
    """A whole run id as given, or the one run of ``job`` (its 500 newest) whose id ends with ``given``."""
    if not SHORT_ID_PATTERN.fullmatch(given):
        return given
    if job is None:
        raise click.UsageError(f"{given} is a short run id: give --job JOB_ID too (the job whose runs list "
                               "showed it), or the whole id (`chimes runs list JOB_ID --wide`)")
    page = api.call("GET", _path("jobs", _job_id(api, job), "runs"), params={"limit": 500})
    found = [str(r["runId"]) for r in page.get("runs") or [] if str(r.get("runId", "")).lower().endswith(given.lower())]
    if len(found) != 1:
        raise ClientError(f"{len(found) or 'no'} runs of job {job} have an id ending in {given}")
    return found[0]


job_of_run_option = click.option("--job", "job", metavar="JOB_ID", help="The run's job, to take a short run id.")


def _path(*parts: str) -> str:
    return "/" + "/".join(quote(p, safe="") for p in parts)


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


def _pages(api: Api, path: str, key: str, params: dict[str, Any],
           follow: bool) -> tuple[list[Any], str | None]:
    items: list[Any] = []
    cursor, seen = None, set()
    while True:
        page = api.call("GET", path, params={**params, "cursor": cursor})
        items += page.get(key) or []
        cursor = page.get("nextCursor")
        if not follow or not cursor or cursor in seen:
            return items, cursor
        seen.add(cursor)


# ----------------------------------------------------------------------------------------------- jobs


@click.group()
def jobs() -> None:
    """Create, list, change and trigger jobs through the API."""


def _schedule_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed([
        click.option("--name", help="Job name."),
        click.option("--cron", help="Cron expression (5 fields, 6 with seconds, or @daily etc.)."),
        click.option("--timezone", help="IANA timezone of --cron (default UTC)."),
        click.option("--at", help="One-off run time, RFC 3339 with an offset, e.g. 2026-12-01T09:00:00Z."),
        click.option("--max-attempts", type=click.IntRange(1, 100), help="Attempts before the run fails."),
        click.option("--timeout", type=click.IntRange(1), help="Seconds an attempt may take."),
        click.option("--concurrency", type=click.Choice(["skip", "queue", "allow"]),
                     help="What to do when a run is due while the last one still runs."),
        click.option("--priority", type=click.Choice(["high", "normal", "batch"]), help="Queue tier."),
        click.option("--catch-up", type=click.Choice(["one", "all", "none"]),
                     help="What happens to fires missed while the scheduler was down or the job paused."),
        click.option("--tag", "tags", multiple=True, help="A tag, for fleet-wide caps (repeatable)."),
        click.option("--notify-url", help="Webhook told when a run fails for good, starts late or stalls."),
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
def create(api: Api, file: IO[str] | None, idempotency_key: str | None, **opts: Any) -> None:
    """Create a job: --name, --cron or --at, and --url or --command; or --file job.json."""
    if file is not None:
        given = [f"--{k.replace('_', '-')}" for k, v in opts.items() if v not in (None, ())]
        if given:
            raise click.UsageError(f"--file cannot be combined with {', '.join(given)}; put them in the file")
        definition = _read_json(file, "--file")
    else:
        definition = _definition(opts)
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
    created = api.call("POST", "/jobs", body=definition, headers=headers)
    click.echo(f"created job {created.get('jobId')}")
    click.echo(f"next run: {render.when(created.get('nextRunAt')) or 'none'}")


def _definition(opts: dict[str, Any]) -> dict[str, Any]:
    if not opts["name"]:
        raise click.UsageError("give --name (or a whole job with --file)")
    definition: dict[str, Any] = {"name": opts["name"], "schedule": _new_schedule(opts), "task": _task(opts)}
    return definition | _tuning(opts)


def _new_schedule(opts: dict[str, Any]) -> dict[str, Any]:
    if bool(opts["cron"]) == bool(opts["at"]):
        raise click.UsageError("give exactly one of --cron (recurring) or --at (one-off)")
    if opts["at"]:
        if opts["timezone"]:
            raise click.UsageError("--timezone goes with --cron; give --at with an offset instead")
        return {"at": opts["at"]}
    return {"cron": opts["cron"], "timezone": opts["timezone"] or "UTC"}


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
    return out


@jobs.command("list")
@api_options
@click.option("--limit", type=click.IntRange(1, 500), help="Jobs per page (the API's default is 50).")
@click.option("--all", "follow", is_flag=True, help="Follow nextCursor and list every job.")
@json_option
@wide_option
def list_jobs(api: Api, limit: int | None, follow: bool, as_json: bool, wide: bool) -> None:
    """List your jobs (short ids and relative times in a terminal under 120 columns)."""
    items, cursor = _pages(api, "/jobs", "jobs", {"limit": limit}, follow)
    if as_json:
        _echo_json({"jobs": items, "nextCursor": cursor})
        return
    _show(render.jobs_table(items, wide=_wide(wide)))
    if cursor:
        click.echo("more jobs: pass --all to list them all", err=True)


@jobs.command("get")
@api_options
@click.argument("job_id")
@json_option
def get_job(api: Api, job_id: str, as_json: bool) -> None:
    """Show one job and its definition."""
    job = api.call("GET", _path("jobs", _job_id(api, job_id)))
    if as_json:
        _echo_json(job)
    else:
        _show(render.job_detail(job))


def _patch(api: Api, job_id: str, patch: dict[str, Any], read_version: int | None = None) -> dict[str, Any]:
    """PATCH the job; ``read_version``: the version the patch was computed from, sent as If-Match so
    that a change made in between is refused (412) rather than overwritten."""
    headers = {"If-Match": f'"{read_version}"'} if read_version is not None else None
    return api.call("PATCH", _path("jobs", job_id), body=patch, headers=headers)


@jobs.command("pause")
@api_options
@click.argument("job_id")
def pause(api: Api, job_id: str) -> None:
    """Pause a job: no runs fire until it is resumed."""
    job_id = _job_id(api, job_id)
    _patch(api, job_id, {"paused": True})
    click.echo(f"paused job {job_id}")


@jobs.command("resume")
@api_options
@click.argument("job_id")
def resume(api: Api, job_id: str) -> None:
    """Resume a paused job."""
    job_id = _job_id(api, job_id)
    job = _patch(api, job_id, {"paused": False})
    click.echo(f"resumed job {job_id}; next run: {render.when((job or {}).get('nextRunAt')) or 'none'}")


@jobs.command("update")
@api_options
@_schedule_options
@click.option("--file", type=click.File("r"),
              help="A PATCH body as JSON ('-' for stdin); options override it.")
@click.argument("job_id")
def update(api: Api, job_id: str, file: IO[str] | None, **opts: Any) -> None:
    """Change a job; fields not given stay as they are."""
    job_id = _job_id(api, job_id)
    patch = _read_json(file, "--file") if file is not None else {}
    current: dict[str, Any] = {}

    def job() -> dict[str, Any]:
        if not current:
            current.update(api.call("GET", _path("jobs", job_id)))
        return current

    if opts["name"]:
        patch["name"] = opts["name"]
    if opts["at"] or opts["cron"] or opts["timezone"]:
        patch["schedule"] = _changed_schedule(opts, job)
    tuning = _tuning(opts)
    if "retryPolicy" in tuning:
        tuning["retryPolicy"] = {**(job().get("retryPolicy") or {}), **tuning["retryPolicy"]}
    patch |= tuning
    if not patch:
        raise click.UsageError("nothing to change: give at least one option or --file")
    updated = _patch(api, job_id, patch, current.get("version")) or {}
    click.echo(f"updated job {job_id} (version {updated.get('version', '?')}); "
               f"next run: {render.when(updated.get('nextRunAt')) or 'none'}")


def _changed_schedule(opts: dict[str, Any], job: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    if opts["at"]:
        if opts["cron"] or opts["timezone"]:
            raise click.UsageError("give either --at or --cron/--timezone")
        return {"at": opts["at"]}
    schedule = job().get("schedule") or {}
    if "cron" not in schedule:
        if not opts["cron"]:
            raise click.UsageError("this job runs once (--at); give --cron to make it recurring")
        schedule = {}
    changed = {**schedule, "cron": opts["cron"] or schedule["cron"]}
    changed["timezone"] = opts["timezone"] or schedule.get("timezone") or "UTC"
    return changed


@jobs.command("delete")
@api_options
@click.argument("job_id")
def delete(api: Api, job_id: str) -> None:
    """Delete a job (its run history stays listable with `chimes runs list JOB_ID`)."""
    job_id = _job_id(api, job_id)
    api.call("DELETE", _path("jobs", job_id))
    click.echo(f"deleted job {job_id}")


@jobs.command("run")
@api_options
@click.argument("job_id")
def run_now(api: Api, job_id: str) -> None:
    """Trigger a manual run now; prints the run id."""
    started = api.call("POST", _path("jobs", _job_id(api, job_id), "runs"))
    click.echo(f"started run {started.get('runId')}")


@jobs.command("backfill")
@api_options
@click.argument("job_id")
@click.option("--start", required=True, help="Start of the past range (exclusive), RFC 3339 with an offset.")
@click.option("--end", required=True, help="End of the past range (inclusive), RFC 3339 with an offset.")
def backfill(api: Api, job_id: str, start: str, end: str) -> None:
    """Create the runs the schedule would have made in a past range (at most 1,000; slots that
    already have a run keep it)."""
    made = api.call("POST", _path("jobs", _job_id(api, job_id), "backfill"), body={"start": start, "end": end})
    click.echo(f"created {made.get('created')} runs; {made.get('existing')} slots already had one")


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
def list_runs(api: Api, job_id: str, status: str | None, limit: int | None, as_json: bool, wide: bool) -> None:
    """List a job's runs, newest scheduled time first (also a deleted job's, until retention)."""
    page = api.call("GET", _path("jobs", _job_id(api, job_id), "runs"), params={"status": status, "limit": limit})
    if as_json:
        _echo_json(page)
        return
    _show(render.runs_table(page.get("runs") or [], wide=_wide(wide)))
    if page.get("jobDeleted"):
        click.echo("this job was deleted; its runs stay until retention removes them", err=True)
    if page.get("nextCursor"):
        click.echo("more runs: pass a larger --limit to see them", err=True)


@runs.command("get")
@api_options
@click.argument("run_id")
@job_of_run_option
@json_option
def get_run(api: Api, run_id: str, job: str | None, as_json: bool) -> None:
    """Show a run, its attempts and the last attempt's output."""
    run = api.call("GET", _path("runs", _run_id(api, run_id, job)))
    if as_json:
        _echo_json(run)
    else:
        _show(render.run_detail(run))


@runs.command("rerun")
@api_options
@click.argument("run_id")
@job_of_run_option
def rerun(api: Api, run_id: str, job: str | None) -> None:
    """Run that run's job again now, as a new run."""
    started = api.call("POST", _path("runs", _run_id(api, run_id, job), "rerun"))
    click.echo(f"started run {started.get('runId')}")


@runs.command("cancel")
@api_options
@click.argument("run_id")
@job_of_run_option
def cancel(api: Api, run_id: str, job: str | None) -> None:
    """Cancel a run that has not finished."""
    run = api.call("POST", _path("runs", _run_id(api, run_id, job), "cancel")) or {}
    click.echo(f"run {run_id}: {run.get('status', 'cancel requested')}")


@runs.command("watch")
@api_options
@click.argument("job_id")
@click.option("--interval", type=click.FloatRange(0.1), default=1.0, show_default=True,
              help="Seconds between refreshes.")
@status_option
@limit_option
@wide_option
def watch(api: Api, job_id: str, interval: float, status: str | None, limit: int | None, wide: bool) -> None:
    """Show a job's runs, refreshed every --interval seconds, until Ctrl-C."""
    job_id = _job_id(api, job_id)

    def table() -> Any:
        page = api.call("GET", _path("jobs", job_id, "runs"), params={"status": status, "limit": limit})
        title = f"runs of job {job_id} at {time.strftime('%H:%M:%SZ', time.gmtime())} (Ctrl-C to stop)"
        return render.runs_table(page.get("runs") or [], title=title, wide=_wide(wide))

    try:
        with Live(table(), console=Console(), auto_refresh=False) as live:
            while True:
                _sleep(interval)
                live.update(table(), refresh=True)
    except KeyboardInterrupt:
        pass
