"""Pure helpers that turn records into what the pages show: times, durations, schedules, timelines.

No I/O and no clock reads: ``now`` is passed in, so every helper is tested with plain values.
"""

from __future__ import annotations

import itertools
import re
import shlex
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from chimes import previews, schedules
from chimes.calendars import Calendar

FINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled", "skipped"})
# Header and environment names whose values are secrets more often than not: shown masked.
_SECRET_NAME = re.compile(r"auth|token|secret|passw|key|cookie|session|credential", re.IGNORECASE)
MASK = "••••••"
EN_DASH = "\u2013"


class Row(Protocol):
    """A row read by column name: a database record or a plain mapping."""

    def __getitem__(self, key: str, /) -> Any: ...


def ago(moment: datetime | None, now: datetime) -> str:
    """``12 s ago`` or ``in 5 s``: how far a moment is from now, in the largest sensible unit."""
    if moment is None:
        return "—"
    seconds = (now - moment).total_seconds()
    text = _span(abs(seconds))
    if text == "now":
        return "just now"
    return f"{text} ago" if seconds >= 0 else f"in {text}"


def _span(seconds: float) -> str:
    if seconds < 1:
        return "now"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{int(seconds // size)} {unit}"
    return f"{int(seconds)} s"


def duration(seconds: float | None) -> str:
    """``85 ms``, ``1.4 s``, ``2 min 5 s``, ``3 h 4 min``: precise for short spans, coarse for long."""
    if seconds is None:
        return "—"
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        minutes, rest = divmod(int(seconds), 60)
        return f"{minutes} min {rest} s" if rest else f"{minutes} min"
    hours, rest = divmod(int(seconds) // 60, 60)
    return f"{hours} h {rest} min" if rest else f"{hours} h"


def between(start: datetime | None, end: datetime | None) -> float | None:
    return None if start is None or end is None else (end - start).total_seconds()


def utc(moment: datetime | None) -> str:
    return "—" if moment is None else moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def clock(moment: datetime | None, now: datetime) -> str:
    """``00:14:10`` today, ``Dec 01 02:00:00`` another day, ``2027-01-01 02:00`` another year (UTC)."""
    if moment is None:
        return "—"
    if moment.date() == now.date():
        return moment.strftime("%H:%M:%S")
    return moment.strftime("%b %d %H:%M:%S" if moment.year == now.year else "%Y-%m-%d %H:%M")


def iso(moment: datetime | None) -> str:
    return "" if moment is None else moment.isoformat().replace("+00:00", "Z")


def short_id(value: Any) -> str:
    """The end of an id: run ids begin with their time, so their ends tell them apart."""
    return "…" + str(value)[-8:]


def schedule_text(definition: Mapping[str, Any]) -> str:
    schedule = definition["schedule"]
    if "at" in schedule:
        return f"once at {utc(schedule['at'])}"
    return schedules.wire_text(schedule)


def next_fires(definition: Mapping[str, Any], next_run_at: datetime | None, job_id: uuid.UUID,
               count: int = 5, slots_fired: int = 0, calendars: Sequence[Calendar] = ()) -> list[datetime]:
    """The next ``count`` fire times, starting from the job's pending trigger, as the scheduler fires
    them (DST policy, jitter, interval phase, bounds, run cap, calendars): the API's preview
    (chimes.previews)."""
    return previews.upcoming(definition, job_id, next_run_at, count, slots_fired, calendars)


def task_summary(task: Mapping[str, Any]) -> str:
    if task.get("type") == "http":
        return f"{task.get('method', 'POST')} {task.get('url', '')}"
    if task.get("type") == "command":
        return shlex.join(task.get("argv", []))
    return str(task.get("type", "unknown task"))


def masked(values: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """Headers or environment variables, with the values of secret-looking names masked."""
    return [(name, MASK if _SECRET_NAME.search(name) else str(value)) for name, value in (values or {}).items()]


def partition_ranges(partitions: Sequence[int]) -> str:
    """``[0, 1, 2, 7]`` -> ``0-2, 7`` (with an en dash): a node's partitions, readable."""
    ordered = sorted(partitions)
    if not ordered:
        return ""
    ranges: list[str] = []
    start = prev = ordered[0]
    for p in ordered[1:]:
        if p == prev + 1:
            prev = p
        else:
            ranges.append(_range(start, prev))
            start = prev = p
    ranges.append(_range(start, prev))
    return ", ".join(ranges)


def _range(start: int, end: int | None) -> str:
    return str(start) if start == end else f"{start}{EN_DASH}{end}"


@dataclass(frozen=True, slots=True)
class Bar:
    label: str
    value: int
    percent: float  # of the tallest bar, for the CSS height or width
    title: str = ""


def bars(labelled: Iterable[tuple[str, int, str]]) -> list[Bar]:
    items = list(labelled)
    top = max((value for _, value, _ in items), default=0) or 1
    return [Bar(label, value, round(100 * value / top, 1), title) for label, value, title in items]


def lag_bars(bounds: Sequence[float], counts: Sequence[int]) -> list[Bar]:
    """Histogram bars for fire lag; bucket i holds lags in [bounds[i-1], bounds[i]) seconds."""
    labels = [f"< {bounds[0]:g} s"]
    labels += [f"{lo:g}{EN_DASH}{hi:g} s" for lo, hi in itertools.pairwise(bounds)]
    labels.append(f"\u2265 {bounds[-1]:g} s")
    return bars((label, count, f"{count} runs fired {label} late") for label, count in zip(labels, counts, strict=True))


def minute_bars(rows: Iterable[Row], now: datetime, minutes: int) -> list[Bar]:
    """One bar per minute for the last ``minutes`` minutes, zeros included."""
    counts = {row["minute"]: row["failed"] for row in rows}
    current = now.replace(second=0, microsecond=0)
    slots = [current - timedelta(minutes=i) for i in range(minutes - 1, -1, -1)]
    return bars((slot.strftime("%H:%M"), counts.get(slot, 0), f"{counts.get(slot, 0)} failed at {slot:%H:%M} UTC")
                for slot in slots)


@dataclass(frozen=True, slots=True)
class Span:
    """A stretch of a run's timeline, placed in percent of the whole."""

    label: str
    kind: str  # wait | attempt-succeeded | attempt-failed | attempt-running | ...
    left: float
    width: float
    title: str


@dataclass(frozen=True, slots=True)
class Event:
    label: str
    at: datetime
    offset: float  # seconds after the scheduled time
    kind: str = "event"


def timeline(run: Mapping[str, Any], attempts: Sequence[Mapping[str, Any]],
             now: datetime) -> tuple[list[Span], list[Event]]:
    """The run from its scheduled time to its end (or now): one span per attempt, and what happened when."""
    start = run["scheduled_at"]
    shown = [a for a in attempts if a["started_at"] is not None]
    end = max([run["finished_at"] or now, *(a["finished_at"] or now for a in shown)])
    total = max((end - start).total_seconds(), 0.001)
    events = [Event("scheduled", start, 0.0)]
    if run["fired_at"]:
        events.append(Event("fired", run["fired_at"], _after(start, run["fired_at"])))
    spans = []
    for attempt in shown:
        number, status = attempt["attempt"], attempt["status"]
        began, ended = attempt["started_at"], attempt["finished_at"] or now
        events.append(Event(f"attempt {number} started", began, _after(start, began)))
        if attempt["finished_at"]:
            events.append(Event(f"attempt {number} {status}", ended, _after(start, ended), kind=status))
        left = min(99.4, 100 * _after(start, began) / total)
        width = min(100 - left, max(0.6, 100 * _after(began, ended) / total))
        spans.append(Span(f"attempt {number}", f"attempt-{status}", round(left, 2), round(width, 2),
                          f"attempt {number}: {status}, {duration(_after(began, ended))}"))
    if run["finished_at"] and not shown:
        events.append(Event(run["status"], run["finished_at"], _after(start, run["finished_at"]), kind=run["status"]))
    return spans, sorted(events, key=lambda e: e.at)


def _after(start: datetime, moment: datetime) -> float:
    return max(0.0, (moment - start).total_seconds())
