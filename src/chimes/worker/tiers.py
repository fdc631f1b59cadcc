"""How a worker shares its free slots between the priority tiers of the run queue.

High before normal before batch, so a backlog of batch runs never delays a high one; batch runs may
fill at most ``batch_share`` of the worker, so long batch runs cannot take every slot; and every
``every``-th claim lets the lower tiers go first with a small share, so they are never starved.

Owners share a worker the same way: the runs of one owner may hold at most ``owner_share`` of its
slots, so that one team's long runs, however many, always leave room for another team's to start.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from chimes.enums import Priority

#: The most of a worker's slots the runs of one owner hold, by default (``--owner-share``).
OWNER_SHARE = 0.8


@dataclass(frozen=True, slots=True)
class TierPolicy:
    batch_share: float = 0.8
    every: int = 5
    low_share: float = 0.1

    owner_share: float = OWNER_SHARE  # 1.0: an owner may fill a worker (a fleet that serves one team)

    def batch_cap(self, concurrency: int) -> int:
        return max(1, int(concurrency * self.batch_share))

    def owner_cap(self, concurrency: int) -> int:
        return max(1, int(concurrency * self.owner_share))


@dataclass(frozen=True, slots=True)
class OwnerRoom:
    """What the owners running on a worker leave of a claim: the owners at their cap, whose runs the
    claim skips, and the most runs the claim may take so that no other owner passes its cap (an owner
    with none running has the whole cap). ``refill``: for each owner at its cap, how many of its runs
    are to end before a claim for it is worth a round trip (a quarter of the cap, at least one), so
    that an owner with more runs queued than its share gets them a batch at a time as its runs end."""

    full: list[str]
    at_most: int
    refill: dict[str, int] = field(default_factory=dict)


def owner_room(owners: Iterable[str], cap: int, limit: int) -> OwnerRoom:
    """``owners``: the owner of each run in flight on the worker. Pure, so it is tested without a database."""
    full: list[str] = []
    refill: dict[str, int] = {}
    at_most = min(limit, cap)
    for owner, running in Counter(owners).items():
        if running >= cap:
            full.append(owner)
            refill[owner] = running - cap + max(1, cap // 4)
        else:
            at_most = min(at_most, cap - running)
    return OwnerRoom(sorted(full), at_most, refill)


@dataclass(frozen=True, slots=True)
class ClaimStep:
    lowest: Priority
    highest: Priority
    at_most: int  # before subtracting what earlier steps of the same cycle claimed


def claim_steps(policy: TierPolicy, cycle: int, free: int, batch_room: int) -> list[ClaimStep]:
    """The claims of one cycle, in order. Pure, so it is tested without a database."""
    steps: list[ClaimStep] = []
    if cycle % policy.every == 0:
        share = max(1, int(free * policy.low_share))
        steps += [ClaimStep(Priority.BATCH, Priority.BATCH, min(share, batch_room)),
                  ClaimStep(Priority.NORMAL, Priority.NORMAL, share)]
    steps += [ClaimStep(Priority.HIGH, Priority.NORMAL, free), ClaimStep(Priority.BATCH, Priority.BATCH, batch_room)]
    return [s for s in steps if s.at_most > 0]
