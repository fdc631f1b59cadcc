"""Tables for ``chimes jobs`` and ``chimes runs`` (client.py calls the API through chimes.client)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from chimes import schedules

# Fields of GET /jobs/{id} that the server adds; the rest is the job's definition.
JOB_METADATA = ("jobId", "owner", "paused", "version", "nextRunAt", "createdAt", "updatedAt", "lastRun",
                "scheduleEnded", "nextRuns", "remainingRuns")
ERROR_WIDTH = 60
OUTPUT_LINES = 40
WIDE_COLUMNS = 120  # from this terminal width on, lists show whole ids and times
SHORT_ID = 8        # characters of an id a narrow list shows: the end, the random part of a UUIDv7


def short_id(value: Any) -> str:
    """The last SHORT_ID characters of an id: the start of a UUIDv7 is its time, shared by ids made
    in the same minute; the end is random. The CLI takes them back wherever it takes a job id."""
    text = "" if value is None else str(value)
    return text[-SHORT_ID:]


def relative(value: str | None, now: datetime | None = None) -> str:
    """An RFC 3339 time as ``in 5m`` / ``3h ago`` (``now`` within a second); empty for none."""
    if not value:
        return ""
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return value
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    seconds = (parsed - (now or datetime.now(UTC))).total_seconds()
    if abs(seconds) < 1:
        return "now"
    amount = abs(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if amount >= size:
            text = f"{int(amount // size)}{unit}"
            break
    return f"in {text}" if seconds > 0 else f"{text} ago"


def when(value: str | datetime | None) -> str:
    """An RFC 3339 time (or a datetime) as ``YYYY-MM-DD HH:MM:SSZ`` in UTC; empty for none, as given
    if unparsable."""
    if not value:
        return ""
    if isinstance(value, datetime):
        parsed = value
    else:
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            return value
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def truncate(text: str | None, width: int = ERROR_WIDTH) -> str:
    if not text:
        return ""
    line = " ".join(str(text).split())
    return line if len(line) <= width else line[: width - 1] + "…"


def schedule_text(schedule: dict[str, Any] | None) -> str:
    if not schedule:
        return ""
    if "at" in schedule:
        return f"at {when(schedule['at'])}"
    return schedules.wire_text(schedule)


def task_text(task: dict[str, Any] | None) -> str:
    if not task:
        return ""
    kind = task.get("type")
    if kind == "http":
        return f"http {task.get('method', 'POST')} {task.get('url', '')}"
    if kind == "command":
        return "command " + " ".join(task.get("argv") or [])
    if kind == "container":
        return f"container {task.get('image', '')} " + " ".join(task.get("command") or [])
    return json.dumps(task)


def _id_column(table: Table, title: str) -> None:
    table.add_column(title, no_wrap=True, overflow="fold")


def jobs_table(jobs: list[dict[str, Any]], wide: bool = True) -> Table:
    if not wide:
        return _narrow_jobs_table(jobs)
    table = Table()
    _id_column(table, "id")
    for title in ("name", "schedule", "next run", "paused", "last run"):
        table.add_column(title)
    for job in jobs:
        last = job.get("lastRun") or {}
        _row(table, str(job.get("jobId", "")), job.get("name", ""), schedule_text(job.get("schedule")),
                      when(job.get("nextRunAt")), "yes" if job.get("paused") else "",
                      last.get("status", ""))
    return table


def _narrow_table(title: str | None = None) -> Table:
    """No vertical rules and one space between columns: every column a terminal can spare goes to text."""
    return Table(title=title, box=None, pad_edge=False, padding=(0, 1), header_style="bold underline")


def _narrow_jobs_table(jobs: list[dict[str, Any]]) -> Table:
    """Short ids, the cron expression, relative times: fits 80 columns, the name gets what is left."""
    table = _narrow_table()
    table.add_column("id", no_wrap=True, min_width=SHORT_ID)
    table.add_column("name", overflow="ellipsis", no_wrap=True, ratio=3, min_width=8)
    table.add_column("schedule", overflow="ellipsis", no_wrap=True, ratio=2, min_width=9)
    table.add_column("next", no_wrap=True)
    table.add_column("last run", no_wrap=True)
    now = datetime.now(UTC)
    for job in jobs:
        last = job.get("lastRun") or {}
        schedule = job.get("schedule") or {}
        next_run = "paused" if job.get("paused") else relative(job.get("nextRunAt"), now)
        last_run = f"{last.get('status', '')} {relative(last.get('scheduledAt'), now)}".strip()
        _row(table, short_id(job.get("jobId")), job.get("name", ""),
             _short_schedule(schedule), next_run or "-", last_run)
    return table


def _short_schedule(schedule: dict[str, Any]) -> str:
    if "at" in schedule:
        return "once"
    if "everySec" in schedule:
        return schedules.describe(schedules.IntervalSchedule(schedule["everySec"], schedule.get("phaseSec") or 0))
    return str(schedule.get("cron") or "")


def job_detail(job: dict[str, Any]) -> Group:
    last = job.get("lastRun") or {}
    last_run = f"{last.get('status', '')} {when(last.get('scheduledAt'))} {last.get('runId', '')}".strip()
    rows = [
        ("id", job.get("jobId")), ("name", job.get("name")), ("owner", job.get("owner")),
        ("schedule", schedule_text(job.get("schedule"))), ("task", task_text(job.get("task"))),
        ("paused", _paused_text(job)), ("version", job.get("version")),
        ("next run", when(job.get("nextRunAt"))), ("created", when(job.get("createdAt"))),
        ("updated", when(job.get("updatedAt"))),
        ("last run", last_run),
    ]
    if job.get("remainingRuns") is not None:
        rows.append(("runs left", f"{job['remainingRuns']} of {job['schedule'].get('maxRuns')}"))
    if job.get("scheduleEnded"):
        rows.append(("ended", "past its endAt or maxRuns: nothing is left to fire"))
    if job.get("nextRuns") is not None:
        rows.append(("next runs", "\n".join(when(t) for t in job["nextRuns"]) or "none"))
    definition = {k: v for k, v in job.items() if k not in JOB_METADATA}
    return Group(_key_values(rows), Text("definition:"), Text(json.dumps(definition, indent=2)))


def _paused_text(job: dict[str, Any]) -> str:
    """``no``, or since when, by whom and why: "yes, since 09:00 by ops-bot: incident 123"."""
    if not job.get("paused"):
        return "no"
    text = "yes"
    if job.get("pausedAt"):
        text += f", since {when(job['pausedAt'])}"
    if job.get("pausedBy"):
        text += f" by {job['pausedBy']}"
    if job.get("pauseNote"):
        text += f": {job['pauseNote']}"
    return text


def runs_table(runs: list[dict[str, Any]], title: str | None = None, wide: bool = True) -> Table:
    if not wide:
        return _narrow_runs_table(runs, title)
    table = Table(title=title)
    _id_column(table, "run id")
    for title_ in ("scheduled", "status", "attempt", "trigger", "started", "finished", "error"):
        table.add_column(title_)
    for run in runs:
        _row(table, str(run.get("runId", "")), when(run.get("scheduledAt")), run.get("status", ""),
                      str(run.get("attempt", "")), run.get("trigger", ""), when(run.get("startedAt")),
                      when(run.get("finishedAt")), truncate(run.get("error")))
    return table


def run_line(run: dict[str, Any]) -> str:
    """A run as one line of ``chimes runs watch`` off a terminal: whole id, times in UTC, no colours."""
    fields = [str(run.get("runId", "")), when(run.get("scheduledAt")).replace(" ", "T"), run.get("status", ""),
              f"attempt={run.get('attempt', '')}", f"trigger={run.get('trigger', '')}"]
    if run.get("finishedAt"):
        fields.append(f"finished={when(run.get('finishedAt')).replace(' ', 'T')}")
    if run.get("error"):
        fields.append("error=" + " ".join(str(run["error"]).split()))
    return "  ".join(fields)


def _narrow_runs_table(runs: list[dict[str, Any]], title: str | None) -> Table:
    table = _narrow_table(title)
    table.add_column("run", no_wrap=True, min_width=SHORT_ID)
    for name in ("scheduled", "status", "try", "trigger"):
        table.add_column(name, no_wrap=True)
    table.add_column("error", overflow="ellipsis", no_wrap=True, ratio=1, min_width=5)
    now = datetime.now(UTC)
    for run in runs:
        _row(table, short_id(run.get("runId")), relative(run.get("scheduledAt"), now), run.get("status", ""),
             str(run.get("attempt", "")), run.get("trigger", ""), " ".join(str(run.get("error") or "").split()))
    return table


def run_detail(run: dict[str, Any]) -> Group:
    rows = [
        ("run id", run.get("runId")), ("job id", run.get("jobId")), ("status", run.get("status")),
        ("trigger", run.get("trigger")), ("scheduled", when(run.get("scheduledAt"))),
        ("started", when(run.get("startedAt"))), ("finished", when(run.get("finishedAt"))),
        ("attempt", run.get("attempt")), ("error", run.get("error")),
    ]
    attempts = run.get("attempts") or []
    parts: list[Any] = [_key_values(rows), attempts_table(attempts)]
    output = attempts[-1].get("output") if attempts else None
    if output:
        tail = "\n".join(str(output).splitlines()[-OUTPUT_LINES:])
        parts += [Text(f"output of attempt {attempts[-1].get('attempt')} (tail):"), Text(tail)]
    return Group(*parts)


def attempts_table(attempts: list[dict[str, Any]]) -> Table:
    table = Table(title="attempts")
    table.add_column("attempt")
    _id_column(table, "worker")
    for title in ("status", "started", "finished", "error"):
        table.add_column(title)
    for a in attempts:
        _row(table, str(a.get("attempt", "")), a.get("workerId") or "", a.get("status", ""),
                      when(a.get("startedAt")), when(a.get("finishedAt")), truncate(a.get("error")))
    return table


def _row(table: Table, *cells: Any) -> None:
    """Cells as plain text: a message with [brackets] is not rich markup."""
    table.add_row(*(Text("" if cell is None else str(cell)) for cell in cells))


def _key_values(rows: list[tuple[str, Any]]) -> Table:
    table = Table(show_header=False, box=None)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for key, value in rows:
        _row(table, key, value)
    return table
