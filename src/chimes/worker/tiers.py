"""How a worker shares its free slots between the priority tiers of the run queue.

High before normal before batch, so a backlog of batch runs never delays a high one; batch runs may
fill at most ``batch_share`` of the worker, so long batch runs cannot take every slot; and every
``every``-th claim lets the lower tiers go first with a small share, so they are never starved.
"""

from __future__ import annotations

from dataclasses import dataclass

from chimes.enums import Priority


@dataclass(frozen=True, slots=True)
class TierPolicy:
    batch_share: float = 0.8
    every: int = 5
    low_share: float = 0.1

    def batch_cap(self, concurrency: int) -> int:
        return max(1, int(concurrency * self.batch_share))


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
