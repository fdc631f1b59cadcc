"""The timing invariants of a chaos run: takeover after a node is lost (5) and start lag (6).

Both compare with fault windows. A window is widened by the time its fault keeps hurting after it
ends: a scheduler that comes back makes the others shed partitions, a restarted database has to be
reconnected to, a restarted process costs a couple of CPU-seconds on a small machine.

A shard stop (``stop_postgres_shard``) is a fault window for the runs of the stopped home only: the
other homes' runs that waited while it was stopped count as outside every fault, and are also
measured apart, as the blast radius of one shard's outage (11).

A partition move (``--moves``) is a fault window for its range's runs alone, from its first command
to its last plus a lease round; a node loss is judged on the partitions no move touched meanwhile.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

from chimes_chaos.evidence import Evidence, Violation
from chimes_chaos.faults import FaultWindow

START_LAG_P99_SEC = 2.0
BLAST_RADIUS_MIN_RUNS = 10  # fewer other homes' runs during shard stops: measured, not judged
TAKEOVER_SLACK_SEC = 1.0  # a fire's own latency on a loaded machine
LATE = timedelta(seconds=0.5)  # a fire this much after its slot waited for a takeover
# After the window, plus the lease TTL for schedulers (a zone holds one).
SETTLE_SEC = {"scheduler": 3.0, "postgres": 5.0, "worker": 3.0, "zone": 5.0}
# After a partition move ends: the target's nodes take the range's leases within a lease round.
MOVE_SETTLE_SEC = 5.0


def _when(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


def lag_windows(ev: Evidence, home: int | None = None) -> list[tuple[datetime, datetime]]:
    """The spans of time in which a fault may delay starts (target faults cannot: they only fail calls).
    For the runs of ``home``, a shard stop counts only when it stopped that home; ``home`` None: every
    fault counts."""
    windows = []
    for fault in ev.faults:
        if fault.hits not in SETTLE_SEC:
            continue
        if home is not None and fault.stopped_home is not None and fault.stopped_home != home:
            continue
        settle = SETTLE_SEC[fault.hits] + (ev.shape.lease_ttl if fault.hits in ("scheduler", "zone") else 0.0)
        end = fault.ended if fault.ended is not None else ev.faults_ended.timestamp()
        windows.append((_when(fault.started), _when(end + settle)))
    return windows


def _overlaps(first: datetime, last: datetime, windows: list[tuple[datetime, datetime]]) -> bool:
    return any(start <= last and end >= first for start, end in windows)


def takeover_bound(ev: Evidence) -> float:
    shape = ev.shape
    return shape.lease_ttl + shape.lease_renew_sec + 1.0 + TAKEOVER_SLACK_SEC  # TTL, one lease round, one scan


def check_takeovers(ev: Evidence) -> list[Violation]:
    """5: when a scheduler node is killed or frozen past its lease, every fire due in its partitions
    happens within the bound after the loss; checked for *clean* losses (no other scheduler or
    database fault nearby, which would legitimately slow the takeover), measured for all."""
    found = []
    bound = takeover_bound(ev)
    runs_by_partition: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for run in ev.runs:
        if run["fired_at"] is not None and run["trigger"] in ("schedule", "catchup"):
            runs_by_partition[run["partition_id"]].append(run)
    lease_moves, fire_delays, clean_delays = [], [], []
    slowest: list[tuple[float, int, str]] = []
    kept, kept_after = 0, timedelta(seconds=ev.shape.lease_ttl + 0.5)
    for loss in (f for f in ev.faults if f.hits == "scheduler"):
        lost_at = _when(loss.started)
        # A partition under a move pauses for the move's cut-over, not for the loss: left out.
        moving_until = lost_at + timedelta(seconds=bound + ev.shape.lease_ttl)
        held = {p: span for p, span in ev.held_at(loss.victim or "", lost_at).items()
                if not ev.moving(p, lost_at - timedelta(seconds=1), moving_until, MOVE_SETTLE_SEC)}
        for span in held.values():
            following = ev.next_span(span)
            if span.last_valid is not None and span.last_valid > lost_at + kept_after:
                kept += 1  # nobody took it before the frozen owner woke up and renewed it: not a move
            elif following is not None:
                moved = (following.first_seen - lost_at).total_seconds()
                lease_moves.append(moved)
                slowest.append((moved, span.partition, f"{loss.kind} {loss.victim} at {lost_at.isoformat()}: "
                                                       f"{span.owner} token {span.token} -> {following.owner} "
                                                       f"token {following.token}"))
        delays = _fire_delays(runs_by_partition, set(held), lost_at, ev.shape.lease_ttl)
        if not delays:
            continue
        worst = max(delays)
        fire_delays.append(worst)
        if _clean(loss, ev, bound):
            clean_delays.append(worst)
            if worst > bound:
                found.append(Violation(5, f"{loss.kind} {loss.victim} at {lost_at.isoformat()}: a fire in its "
                                          f"partitions came {worst:.2f} s after the loss (bound {bound:.2f} s)"))
    ev.figures["takeover"] = {
        "node_losses": sum(1 for f in ev.faults if f.hits == "scheduler"),
        "bound_sec": round(bound, 2),
        "lease_moved_sec": summary(lease_moves),
        "leases_kept_by_woken_owner": kept,
        "fires_resumed_sec": summary(fire_delays),
        "fires_resumed_clean_sec": summary(clean_delays),
        "slowest_lease_moves": [f"{moved:.1f} s, partition {partition}: {what}"
                                for moved, partition, what in sorted(slowest, reverse=True)[:5]],
    }
    return found


def _fire_delays(runs_by_partition: dict[int, list[dict[str, Any]]], partitions: set[int], lost_at: datetime,
                 lease_ttl: float) -> list[float]:
    """How long after the loss each slot due while the partitions had no live owner fired, for the
    slots that fired late (on-time fires show the node was not needed)."""
    early, late = lost_at - timedelta(seconds=1), lost_at + timedelta(seconds=lease_ttl)
    return [(run["fired_at"] - lost_at).total_seconds()
            for partition in partitions for run in runs_by_partition.get(partition, [])
            if early <= run["scheduled_at"] <= late and run["fired_at"] - run["scheduled_at"] > LATE]


def _clean(loss: FaultWindow, ev: Evidence, bound: float) -> bool:
    start = loss.started - ev.shape.lease_ttl - 2
    end = loss.started + bound
    for other in ev.faults:
        if other is loss or other.hits not in ("scheduler", "postgres", "zone"):
            continue
        other_end = (other.ended or loss.started) + ev.shape.lease_ttl + 2
        if other.started <= end and other_end >= start:
            return False
    return True


def check_start_lag(ev: Evidence) -> list[Violation]:
    """6: start lag (first attempt start minus scheduled time) of fired slots: p99 within 2 s for runs
    that waited while no fault was on; for the others it is measured, not bounded.

    11: with shards, the runs of the homes that were not stopped, that waited while a shard was
    stopped (and under no other fault): p99 within 2 s as well, the blast radius of a shard's outage."""
    by_home: dict[tuple[int, tuple[int, ...]], list[tuple[datetime, datetime]]] = {}
    stops = [(_when(f.started), _when((f.ended or ev.faults_ended.timestamp()) + SETTLE_SEC["postgres"]),
              f.stopped_home) for f in ev.faults if f.stopped_home is not None]
    outside: list[float] = []
    inside: list[float] = []
    fired_outside: list[float] = []
    fired_inside: list[float] = []
    healthy_during_stop: list[float] = []  # other homes' runs while a shard was stopped
    stopped_home: list[float] = []  # the stopped home's runs that waited across its stop
    for run in ev.runs:
        if run["trigger"] not in ("schedule", "catchup"):
            continue
        home = ev.home_at(run["partition_id"], run["scheduled_at"])
        # A move pauses its range's fires and claims from its fence to the cut-over: a fault window
        # for the runs of its range alone.
        moves = tuple(i for i, m in enumerate(ev.moves) if m.covers(run["partition_id"]))
        if (home, moves) not in by_home:
            by_home[(home, moves)] = lag_windows(ev, home) + [
                (_when(ev.moves[i].started), _when((ev.moves[i].ended or ev.faults_ended.timestamp())
                                                   + MOVE_SETTLE_SEC)) for i in moves]
        windows = by_home[(home, moves)]
        # Fire lag by the database's clock (the run's row written), whatever the firing node's clock says.
        fire_lag = (run["created_at"] - run["scheduled_at"]).total_seconds()
        (fired_inside if _overlaps(run["scheduled_at"], run["created_at"], windows) else fired_outside).append(fire_lag)
        if run["status"] == "skipped":
            continue
        attempts = ev.attempts.get(run["run_id"], [])
        first_start = attempts[0]["started_at"] if attempts else run["started_at"]
        if first_start is None:
            continue
        lag = (first_start - run["scheduled_at"]).total_seconds()
        # Inside when a fault was on at any time while the run waited to start.
        faulted = _overlaps(run["scheduled_at"], first_start, windows)
        (inside if faulted else outside).append(lag)
        for start, end, stopped in stops:
            if start <= first_start and end >= run["scheduled_at"]:
                if stopped == home:
                    stopped_home.append(lag)
                elif not faulted:
                    healthy_during_stop.append(lag)
                break
    ev.figures["fire_lag_outside_faults_sec"] = summary(fired_outside)
    ev.figures["fire_lag_inside_faults_sec"] = summary(fired_inside)
    ev.figures["start_lag_outside_faults_sec"] = summary(outside)
    ev.figures["start_lag_inside_faults_sec"] = summary(inside)
    found = []
    if len(outside) >= 20 and _percentile(outside, 99) > START_LAG_P99_SEC:
        found.append(Violation(6, f"start lag p99 outside fault windows was {_percentile(outside, 99):.2f} s "
                                  f"over {len(outside)} runs (bound {START_LAG_P99_SEC} s)"))
    if stops:
        ev.figures["shard_stops"] = {
            "stops": len(stops),
            "start_lag_other_homes_sec": summary(healthy_during_stop),
            "start_lag_stopped_home_sec": summary(stopped_home),
        }
        if len(healthy_during_stop) >= BLAST_RADIUS_MIN_RUNS and (
                _percentile(healthy_during_stop, 99) > START_LAG_P99_SEC):
            found.append(Violation(11, f"while a shard was stopped, the other homes' start lag p99 was "
                                       f"{_percentile(healthy_during_stop, 99):.2f} s over {len(healthy_during_stop)} "
                                       f"runs (bound {START_LAG_P99_SEC} s)"))
    return found


def _percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def summary(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": round(statistics.median(values), 3), "p99": round(_percentile(values, 99), 3),
            "max": round(max(values), 3)}
