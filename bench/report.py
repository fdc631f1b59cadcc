"""What a scenario measured, as a table for people and as JSON for tools."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


def percentiles(values: Sequence[float]) -> dict[str, float] | None:
    """p50/p95/p99/max by nearest rank; None when there is nothing to summarise."""
    if not values:
        return None
    ordered = sorted(values)

    def rank(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(p * len(ordered)) - 1))]

    return {"p50": rank(0.50), "p95": rank(0.95), "p99": rank(0.99), "max": ordered[-1]}


@dataclass
class Result:
    """One system through one scenario. Lags are seconds after the due time; ``start_lag`` is when the
    task body began (for HTTP tasks: when the target received the call), ``fire_lag`` when the
    scheduler created the run (systems without such a step have none)."""

    system: str
    scenario: str
    runs: int
    completed: int
    drain_sec: float | None  # due time to the last run recorded as finished
    fire_lag: dict[str, float] | None = None
    start_lag: dict[str, float] | None = None
    cpu_sec: dict[str, float] = field(default_factory=dict)  # per process (and "postgresql")
    peak_mb: dict[str, float] = field(default_factory=dict)  # per process
    extra: dict[str, Any] = field(default_factory=dict)
    notes: str = ""
    start_lags: list[float] = field(default_factory=list, repr=False)  # for the chart, not the JSON

    @property
    def throughput(self) -> float | None:
        if not self.drain_sec or not self.completed:
            return None
        return self.completed / self.drain_sec

    @property
    def cpu_per_1000(self) -> float | None:
        if not self.cpu_sec or not self.completed:
            return None
        return sum(self.cpu_sec.values()) / self.completed * 1000

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("start_lags")
        data["throughput_per_sec"] = _round(self.throughput)
        data["cpu_sec_per_1000_runs"] = _round(self.cpu_per_1000)
        return data


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _lag(summary: dict[str, float] | None) -> str:
    if summary is None:
        return "-"
    return "/".join(f"{summary[k]:.2f}" for k in ("p50", "p95", "p99", "max"))


def table(results: Sequence[Result]) -> str:
    headers = ["system", "runs", "drain s", "runs/s", "fire lag p50/p95/p99/max s",
               "start lag p50/p95/p99/max s", "CPU s/1000", "peak MB"]
    rows = []
    for r in results:
        peak = ", ".join(f"{name} {mb:.0f}" for name, mb in r.peak_mb.items()) or "-"
        rows.append([
            r.system, f"{r.completed:,}/{r.runs:,}", "-" if r.drain_sec is None else f"{r.drain_sec:.2f}",
            "-" if r.throughput is None else f"{r.throughput:,.0f}", _lag(r.fire_lag), _lag(r.start_lag),
            "-" if r.cpu_per_1000 is None else f"{r.cpu_per_1000:.2f}", peak,
        ])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    lines = [" | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)),
             "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    for r in results:
        if r.cpu_sec:
            parts = ", ".join(f"{name} {sec:.1f}" for name, sec in r.cpu_sec.items())
            lines.append(f"  {r.system}: CPU seconds {parts}" + (f"; {r.notes}" if r.notes else ""))
        elif r.notes:
            lines.append(f"  {r.system}: {r.notes}")
        if r.extra.get("statements"):
            lines.append(f"  {r.system}: database time by statement (pg_stat_statements)")
            lines += [f"    {float(c['total_ms']):9.1f} ms {int(c['calls']):7d} calls {int(c['rows']):8d} rows  "
                      f"{str(c['query'])[:80]}" for c in r.extra["statements"]]
    return "\n".join(lines)


_ROUND_SUFFIX = re.compile(r", round \d+$")
_SPREAD_FIGURES: list[tuple[str, Callable[[Result], float | None], str]] = [
    ("drain s", lambda r: r.drain_sec, "{:.2f}"),
    ("runs/s", lambda r: r.throughput, "{:,.0f}"),
    ("fire lag p99 s", lambda r: r.fire_lag["p99"] if r.fire_lag else None, "{:.2f}"),
    ("start lag p99 s", lambda r: r.start_lag["p99"] if r.start_lag else None, "{:.2f}"),
    ("CPU s/1000", lambda r: r.cpu_per_1000, "{:.2f}"),
]


def spread_table(results: Sequence[Result]) -> str:
    """min / median / max of each figure for every system that ran more than once (``--repeat``);
    empty when none did."""
    from bench.quiet import spread

    groups: dict[str, list[Result]] = {}
    for r in results:
        groups.setdefault(_ROUND_SUFFIX.sub("", r.system), []).append(r)
    lines = []
    for system, mine in groups.items():
        if len(mine) < 2:
            continue
        parts = []
        for name, figure, fmt in _SPREAD_FIGURES:
            values = [v for v in (figure(r) for r in mine) if v is not None]
            summary = spread(values)
            if summary is not None:
                parts.append(f"{name} " + " / ".join(fmt.format(v) for v in summary))
        if parts:
            lines.append(f"  {system}, {len(mine)} rounds, min / median / max: " + "; ".join(parts))
    return "\n".join(lines)
