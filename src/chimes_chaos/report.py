"""The outcome of a chaos run: what was injected, what was checked, what was violated."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from chimes_chaos.evidence import Violation
from chimes_chaos.invariants import INVARIANTS

SHOWN_PER_INVARIANT = 10
SHARD_INVARIANT = 11  # judged only when a shard was stopped (--shards)
PLACEMENT_INVARIANT = 12  # judged only with shards


@dataclass
class Report:
    seed: int
    duration_sec: float  # of the fault phase
    wall_sec: float  # the whole run, start-up and checks included
    command: str
    work_dir: str
    database: str  # "own embedded PostgreSQL" or "given by URL"
    faults: dict[str, int]  # injected, by kind
    faults_skipped: int  # planned faults the runner could not apply (noted in their window)
    jobs: int
    runs: dict[str, int]  # by status
    attempts: int
    figures: dict[str, Any]
    exits: list[dict[str, Any]]
    violations: list[Violation] = field(default_factory=list)
    database_crashes: list[dict[str, Any]] = field(default_factory=list)  # not injected: PostgreSQL's own
    fault_windows: list[dict[str, Any]] = field(default_factory=list)  # each fault as it really happened
    move_windows: list[dict[str, Any]] = field(default_factory=list)  # each partition move (--moves)

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_json(self) -> str:
        data = asdict(self)
        data["ok"] = self.ok
        data["faults_injected"] = sum(self.faults.values())
        data["runs_checked"] = sum(self.runs.values())
        return json.dumps(data, indent=2, default=str)

    def text(self) -> str:
        by_invariant = Counter(v.invariant for v in self.violations)
        takeover = self.figures.get("takeover", {})
        lines = [
            f"chimes chaos: seed {self.seed}, {self.duration_sec:g} s of faults ({self.wall_sec:.0f} s in all), "
            f"{self.database}",
            f"  command: {self.command}",
            f"  faults injected: {sum(self.faults.values())} ("
            + ", ".join(f"{kind} {n}" for kind, n in sorted(self.faults.items())) + ")",
            f"  jobs: {self.jobs}; runs checked: {sum(self.runs.values())} ("
            + ", ".join(f"{status} {n}" for status, n in sorted(self.runs.items())) + f"); attempts: {self.attempts}; "
            f"deliveries: {self.figures.get('deliveries', 0)}",
            f"  slots checked: {self.figures.get('slots_checked', 0)}; runs in flight at the end: "
            f"{self.figures.get('runs_in_flight_at_end', 0)}; runs delivered again after a 2xx (same key): "
            f"{self.figures.get('runs_redelivered_after_success', 0)}",
            f"  fences at work: stale outcomes refused {self.figures.get('stale_outcomes_refused', 0)}, stale fire "
            f"batches refused {self.figures.get('stale_fire_batches_refused', 0)}, attempts reaped "
            f"{self.figures.get('attempts_reaped', 0)}",
            f"  node losses: {takeover.get('node_losses', 0)}; lease moved after (s): "
            f"{fmt(takeover.get('lease_moved_sec'))} (kept by their woken owner: "
            f"{takeover.get('leases_kept_by_woken_owner', 0)}); fires resumed after (s): "
            f"{fmt(takeover.get('fires_resumed_sec'))}; clean losses: "
            f"{fmt(takeover.get('fires_resumed_clean_sec'))} (bound {takeover.get('bound_sec')} s)",
            f"  fire lag outside fault windows (s): {fmt(self.figures.get('fire_lag_outside_faults_sec'))}",
            f"  fire lag inside fault windows (s): {fmt(self.figures.get('fire_lag_inside_faults_sec'))}",
            f"  start lag outside fault windows (s): {fmt(self.figures.get('start_lag_outside_faults_sec'))}",
            f"  start lag inside fault windows (s): {fmt(self.figures.get('start_lag_inside_faults_sec'))}",
            *self._shard_lines(),
            f"  PostgreSQL crashed on its own (not injected): {len(self.database_crashes)}"
            + "".join(f"\n    {c['note'][:200]}" for c in self.database_crashes),
            f"  processes that exited on their own (restarted): {len(self.exits)}",
            *self._failover_lines(),
            "  invariants:",
        ]
        for number, name in INVARIANTS.items():
            count = by_invariant[number]
            verdict = "ok" if not count else f"{count} VIOLATIONS"
            if number == SHARD_INVARIANT and not count and "shard_stops" not in self.figures:
                verdict = "not checked (no shard was stopped)"
            if number == PLACEMENT_INVARIANT and not count and "rows_placed" not in self.figures:
                verdict = "not checked (one database)"
            lines.append(f"    {number}. {name}: {verdict}")
            shown = [v for v in self.violations if v.invariant == number][:SHOWN_PER_INVARIANT]
            lines += [f"       - {v.what}" for v in shown]
            if count > len(shown):
                lines.append(f"       ... and {count - len(shown)} more")
        lines.append(f"  violations: {len(self.violations)}" + ("" if self.ok else f" (logs in {self.work_dir})"))
        return "\n".join(lines)

    def _shard_lines(self) -> list[str]:
        """With shards: the blast radius of a shard's outage, and how its own runs caught up."""
        lines = []
        if "runs_by_home" in self.figures:
            lines.append("  runs by home: " + ", ".join(f"{home} {n}"
                                                        for home, n in self.figures["runs_by_home"].items()))
        moves = self.figures.get("moves")
        if moves:
            lines.append(f"  partition moves: {moves['moves']} begun, {moves['moves_done']} done, "
                         f"{moves['moves_cancelled']} cancelled ({moves['moves_cancelled_after_kill']} after a kill), "
                         f"{moves['moves_not_begun']} killed before recorded; movers killed "
                         f"{moves['movers_killed']}, resumed {moves['moves_resumed']}, commands failed "
                         f"{moves['move_commands_failed']} (of {moves['move_commands']})")
        stops = self.figures.get("shard_stops")
        if not stops:
            return lines
        return [*lines, f"  shard stops: {stops['stops']}; start lag while one was stopped (s), other homes: "
                f"{fmt(stops.get('start_lag_other_homes_sec'))}; the stopped home: "
                f"{fmt(stops.get('start_lag_stopped_home_sec'))}"]

    def _failover_lines(self) -> list[str]:
        lines = []
        if "api_answers" in self.figures:
            lines.append("  API answers to the harness's writes: " + ", ".join(
                f"{status} {n}" for status, n in self.figures["api_answers"].items()))
        failovers = self.figures.get("failovers") or {}
        moves = failovers.get("primary_moves") or {}
        if moves:
            lines.append(f"  primary moves: {sum(moves.values())} ("
                         + ", ".join(f"{kind} {n}" for kind, n in sorted(moves.items())) + ")")
            lines += [f"    loss to {what.replace('_', ' ')} (s): {fmt(failovers.get(f'loss_to_{what}_sec'))}"
                      for what in ("new_primary", "first_fire", "first_claim", "first_write")]
        return lines


def fmt(summary: dict[str, Any] | None) -> str:
    if not summary or not summary.get("n"):
        return "none"
    return f"n={summary['n']} p50 {summary['p50']} p99 {summary['p99']} max {summary['max']}"
