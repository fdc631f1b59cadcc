"""What a chaos run with failovers must show: nothing acknowledged lost (8), the API answering every
write with a success or a 503 (9), no run at the target before its slot by the host's clock (10),
and how long each move of the primary kept the fleet from writing, firing and claiming.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable
from datetime import datetime

from chimes_chaos.evidence import Evidence, Violation
from chimes_chaos.timing import summary

ANSWERS_ALLOWED = frozenset({200, 201, 204, 429, 503})  # 429: the write limit, which says when to come back


def check_acknowledged(ev: Evidence) -> list[Violation]:
    """8: every job the API answered with 201 is still there; the probe's last acknowledged edit (or
    a later one whose answer was lost) is what the database holds."""
    found = []
    if ev.jobs_found is not None:
        for job in ev.jobs.values():
            if job.job_id not in ev.jobs_found:
                found.append(Violation(8, f"{job.name} ({job.job_id}) was created (201) but is not in the database"))
    if ev.probe is not None:
        acknowledged, held = ev.probe
        if acknowledged >= 0 and (held is None or held < acknowledged):
            found.append(Violation(8, f"the probe's edit {acknowledged} was acknowledged (200) but the job holds "
                                      f"{'no edit' if held is None else f'edit {held}'}"))
        ev.figures["probe_edits_acknowledged"] = acknowledged + 1
    return found


def check_answers(ev: Evidence) -> list[Violation]:
    """9: while the database moved, the API still answered every write: a success, a 429 with when to
    come back, or a 503 with Retry-After; never another error, never silence past the client's timeout."""
    by_status = Counter("no answer" if a.status is None else str(a.status) for a in ev.answers)
    ev.figures["api_answers"] = dict(sorted(by_status.items()))
    bad = [a for a in ev.answers if a.status not in ANSWERS_ALLOWED]
    found = [Violation(9, f"{a.what} sent at {_at(a.sent)}: "
                          f"{'no answer' if a.status is None else a.status} after {a.answered - a.sent:.1f} s "
                          f"{a.detail[:200]}") for a in bad]
    ev.figures["api_answers_not_2xx_429_503"] = len(bad)
    return found


def check_not_early(ev: Evidence) -> list[Violation]:
    """10: no delivery reached the target before its run's slot, by the host's clock, whatever clock the
    node that fired it or the worker that ran it had."""
    slots = {str(r["run_id"]): r["scheduled_at"].timestamp() for r in ev.runs}
    found = []
    for delivery in ev.deliveries:
        slot = slots.get(delivery.run_id or "")
        if slot is not None and delivery.received_at < slot:
            found.append(Violation(10, f"run {delivery.run_id} attempt {delivery.attempt} reached the target "
                                       f"{slot - delivery.received_at:.3f} s before its slot"))
    return found


def failover_figures(ev: Evidence) -> None:
    """For each fault that moved the primary: seconds from the loss (the fault's start) to the new
    primary, to the first run fired, the first attempt claimed and the first write the API accepted
    after it; and fire lag (written minus slot, by the database's clock) inside and outside faults."""
    moves = [w for w in ev.faults if w.promoted is not None]
    created = sorted(r["created_at"].timestamp() for r in ev.runs if r["trigger"] in ("schedule", "catchup"))
    claimed = sorted(a["started_at"].timestamp() for history in ev.attempts.values() for a in history
                     if a["started_at"] is not None)
    accepted = sorted(a.answered for a in ev.answers if a.status is not None and 200 <= a.status < 300)
    to: dict[str, list[float]] = {"new_primary": [], "first_fire": [], "first_claim": [], "first_write": []}
    for move in moves:
        promoted = move.promoted or 0.0
        to["new_primary"].append(promoted - move.started)
        for key, times in (("first_fire", created), ("first_claim", claimed), ("first_write", accepted)):
            first = _first_at_or_after(times, promoted)
            if first is not None:
                to[key].append(first - move.started)
    ev.figures["failovers"] = {
        "primary_moves": dict(Counter(w.kind for w in moves)),
        **{f"loss_to_{key}_sec": summary(values) for key, values in to.items()},
    }


def _first_at_or_after(ordered: list[float], moment: float) -> float | None:
    index = bisect.bisect_left(ordered, moment)
    return ordered[index] if index < len(ordered) else None


def _at(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).astimezone().isoformat(timespec="milliseconds")


def check_failovers(ev: Evidence) -> Iterable[Violation]:
    failover_figures(ev)
    return [*check_acknowledged(ev), *check_answers(ev), *check_not_early(ev)]
