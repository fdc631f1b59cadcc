"""The figures of ``python -m bench peers``: the order of each round, the paired ratios and their
summary, the concurrency check, and the report; pure, so that they are tested without a database.

A *sitting* is one command (``python -m bench peers ... --json FILE``), a *round* one pass of every
system through a variant, their order alternating from round to round. A paired ratio is a peer's
drain over Chimes' drain in the same round of the same variant: above 1, Chimes drained sooner. The
headline is the median of the paired ratios over every round of every sitting given, with their
range; ``python -m bench.peer_report A.json B.json C.json`` prints it for several sittings, which a
published figure needs (:data:`SITTINGS_TO_PUBLISH`).

A system whose target saw more calls at once than it was allowed in flight did not run like the
others: it is flagged, and its rounds are left out of the ratios.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

SITTINGS_TO_PUBLISH = 3
REFERENCE = "chimes"
VARIANT_TITLES = {
    "noop": "no-op task (the queue's and the scheduler's own cost)",
    "http": "HTTP task (one POST through the same client for every system)",
}


def round_order(systems: Sequence[str], round_index: int) -> list[str]:
    """The systems' order in round ``round_index`` (from 0): as given, then reversed, and so on, so
    that no system always runs first, or always right after the same one."""
    return list(systems) if round_index % 2 == 0 else list(reversed(systems))


@dataclass(frozen=True)
class Measurement:
    """One system through one variant in one round of one sitting."""

    sitting: str
    round: int
    variant: str
    system: str  # its key: chimes, pgqueuer, procrastinate, celery
    label: str  # its name and version
    runs: int
    completed: int
    drain_sec: float | None
    stated_in_flight: int  # the runs it was configured to hold in flight at once, all its processes together
    most_in_flight: int | None  # the most calls the target held at once from it (None: no call made)
    busy: bool = False  # the machine was busy as the round began (bench/quiet.py)

    @property
    def over_concurrency(self) -> bool:
        return self.most_in_flight is not None and self.most_in_flight > self.stated_in_flight

    @property
    def measured(self) -> bool:
        """Whether it counts in the ratios: every run done, within its concurrency."""
        return self.drain_sec is not None and self.completed == self.runs and not self.over_concurrency


def flag(m: Measurement) -> str:
    """Why ``m`` is not measured like the others; empty when it is."""
    if m.over_concurrency:
        return (f"NOT MEASURED LIKE THE OTHERS: {m.most_in_flight} calls at once at the target, over its "
                f"{m.stated_in_flight} in flight")
    if m.completed != m.runs or m.drain_sec is None:
        return f"INCOMPLETE: {m.completed:,} of {m.runs:,} runs done"
    return ""


@dataclass(frozen=True)
class Pair:
    sitting: str
    round: int
    ratio: float  # the peer's drain over Chimes'


def paired_ratios(measurements: Iterable[Measurement]) -> dict[tuple[str, str], list[Pair]]:
    """By (variant, peer): each round's ratio of the peer's drain to Chimes' drain in that round,
    for the rounds where both were measured (:attr:`Measurement.measured`)."""
    rounds: dict[tuple[str, int, str], dict[str, Measurement]] = {}
    for m in measurements:
        rounds.setdefault((m.sitting, m.round, m.variant), {})[m.system] = m
    pairs: dict[tuple[str, str], list[Pair]] = {}
    for (sitting, number, variant), systems in rounds.items():
        chimes = systems.get(REFERENCE)
        if chimes is None or not chimes.measured or not chimes.drain_sec:
            continue
        for system, m in systems.items():
            if system == REFERENCE or not m.measured or m.drain_sec is None:
                continue
            pairs.setdefault((variant, system), []).append(Pair(sitting, number, m.drain_sec / chimes.drain_sec))
    for found in pairs.values():
        found.sort(key=lambda p: (p.sitting, p.round))
    return pairs


@dataclass(frozen=True)
class Summary:
    median: float
    low: float
    high: float
    rounds: int
    sittings: int


def summarise(pairs: Sequence[Pair]) -> Summary:
    if not pairs:
        raise ValueError("no paired rounds to summarise")
    ratios = [p.ratio for p in pairs]
    return Summary(statistics.median(ratios), min(ratios), max(ratios), len(pairs), len({p.sitting for p in pairs}))


def describe(summary: Summary) -> str:
    text = (f"{summary.median:.2f}x (range {summary.low:.2f}-{summary.high:.2f}x, {summary.rounds} paired rounds, "
            f"{summary.sittings} sitting{'s' if summary.sittings != 1 else ''})")
    if summary.sittings < SITTINGS_TO_PUBLISH:
        text += f"; fewer than {SITTINGS_TO_PUBLISH} sittings: not a figure to publish"
    return text


def headline(measurements: Sequence[Measurement]) -> list[str]:
    """For each variant and peer: how many times sooner Chimes drained, by the median paired ratio."""
    labels = {m.system: m.label for m in measurements}
    lines = []
    for (variant, system), pairs in sorted(paired_ratios(measurements).items(), key=_by_variant):
        lines.append(f"  {variant}: {labels[system]}'s drain over Chimes': {describe(summarise(pairs))}")
    left_out = [m for m in measurements if not m.measured]
    for m in left_out:
        lines.append(f"  left out: {m.label}, {m.variant}, sitting {m.sitting} round {m.round}: {flag(m)}")
    busy = sum(1 for m in measurements if m.busy)
    if busy:
        lines.append(f"  WARNING: {busy} of {len(measurements)} measurements began on a busy machine "
                     "(bench/quiet.py): their drains are not a quiet machine's")
    return lines


def _by_variant(item: tuple[tuple[str, str], list[Pair]]) -> tuple[int, str]:
    (variant, system), _ = item
    order = list(VARIANT_TITLES)
    return (order.index(variant) if variant in order else len(order), system)


def measurements_of(results: Iterable[dict[str, Any]], sitting: str) -> list[Measurement]:
    """The measurements in a sitting's JSON results (``Result.to_json()`` of ``peers``)."""
    found = []
    for r in results:
        extra = r.get("extra", {})
        if r.get("scenario") != "peers" or "variant" not in extra:
            continue
        in_flight = extra["in_flight"]
        found.append(Measurement(sitting, int(extra["round"]), extra["variant"], extra["system_key"], r["system"],
                                 int(r["runs"]), int(r["completed"]), r["drain_sec"], int(in_flight["stated"]),
                                 in_flight["most_at_target"], bool(extra.get("machine", {}).get("busy"))))
    return found


def _lag(summary: dict[str, float] | None) -> str:
    return "-" if not summary else f"{summary['p50']:.2f} / {summary['p99']:.2f}"


def sitting_table(results: Sequence[Any]) -> str:
    """One sitting's measurements, round by round (``Result`` objects), then its paired ratios."""
    lines = []
    for variant in dict.fromkeys(r.extra["variant"] for r in results):
        mine = [r for r in results if r.extra["variant"] == variant]
        first = mine[0].extra
        lines.append(f"{variant}: {VARIANT_TITLES.get(variant, variant)}; {first['worker_processes']} worker "
                     f"process(es) each, {first['in_flight']['stated']} runs in flight"
                     + (f", the target holding each call {first['hold_ms']:g} ms" if variant == "http" else ""))
        headers = ["round", "system", "drain s", "runs/s", "start lag p50 / p99 s", "most in flight",
                   "CPU s/1000", "load before"]
        rows = []
        for r in mine:
            most = r.extra["in_flight"]["most_at_target"]
            machine = r.extra.get("machine", {})
            rows.append([str(r.extra["round"]), r.system, "-" if r.drain_sec is None else f"{r.drain_sec:.2f}",
                         "-" if r.throughput is None else f"{r.throughput:,.0f}", _lag(r.start_lag),
                         "-" if most is None else f"{most} of {r.extra['in_flight']['stated']}",
                         "-" if r.cpu_per_1000 is None else f"{r.cpu_per_1000:.2f}",
                         f"{machine['load_before'][0]:.2f}" if machine.get("load_before") else "-"])
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
        lines.append("  " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
        lines += ["  " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
        for r in mine:
            note = flag(_measurement(r, "this"))
            if note:
                lines.append(f"  {r.system}, round {r.extra['round']}: {note}")
    lines.append("paired ratios, this sitting (a peer's drain over Chimes' in the same round; above 1, Chimes "
                 "drained sooner):")
    measurements = [_measurement(r, "this") for r in results]
    if not paired_ratios(measurements):
        lines.append("  none: no round measured Chimes and a peer both")
    lines += headline(measurements)
    return "\n".join(lines)


def _measurement(r: Any, sitting: str) -> Measurement:
    (found,) = measurements_of([r.to_json()], sitting)
    return found


def combined(paths: Sequence[Path]) -> str:
    """The headline over several sittings' JSON files, each sitting's command and load beside it."""
    if len(set(paths)) != len(paths):
        raise ValueError("a sitting's file is given twice: each sitting counts once")
    measurements: list[Measurement] = []
    lines = []
    for path in paths:
        data = orjson.loads(path.read_bytes())
        if data.get("scenario") != "peers":
            raise ValueError(f"{path} is not the JSON of `python -m bench peers` (scenario {data.get('scenario')})")
        machine = data["machine"]
        loads = [lo for lo in (_load_before(r) for r in data["results"]) if lo is not None]
        lines.append(f"  {path}: {data.get('command', '(command not recorded)')}; {machine['cores']} cores "
                     f"({machine['cpu']}), load average before each measurement {min(loads, default=0):.2f}-"
                     f"{max(loads, default=0):.2f}")
        measurements += measurements_of(data["results"], str(path))
    return "\n".join(["sittings:", *lines, "paired ratios over every sitting (a peer's drain over Chimes' in the same "
                      "round; above 1, Chimes drained sooner):", *headline(measurements)])


def _load_before(result: dict[str, Any]) -> float | None:
    before = result.get("extra", {}).get("machine", {}).get("load_before")
    return float(before[0]) if before else None


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m bench.peer_report SITTING.json [SITTING.json ...]")
    print(combined([Path(a) for a in argv]))


if __name__ == "__main__":
    main(sys.argv[1:])
