"""The runs a worker process executes at once, shared by its claim loops when it claims from several
databases (shards, docs/scaling.md): a home with nothing to claim leaves its slots to the busy ones,
and no loop waits for another's database."""

from __future__ import annotations

import asyncio


class SlotBudget:
    """``total`` slots for every claim loop of the process. A loop reserves what it is about to claim
    (so two loops claiming at once cannot both take the last slots), gives back what it did not get,
    and gives a slot back when a run ends; every loop waiting for a slot is woken then.

    A reservation is held until the claim answers, and a home whose database hangs (stopped, cut off)
    answers only when the statement times out. So one claim reserves at most :meth:`share` slots, and
    a loop whose last claim failed reserves one (a probe) until a claim succeeds again: a dead home
    never holds the slots of the homes that answer (found by ``chimes chaos --shards``)."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError("a slot budget needs at least one slot")
        self.total = total
        self.in_use = 0
        self.batch_in_use = 0  # of in_use, the slots of batch runs (reserved or running)
        self._waiting: list[asyncio.Event] = []

    def free(self) -> int:
        return self.total - self.in_use

    def share(self) -> int:
        """The most one claim may reserve: the total split evenly between the loops (rounded up)."""
        return max(1, -(-self.total // max(1, len(self._waiting))))

    def watch(self, event: asyncio.Event) -> None:
        """``event`` is set whenever a slot is given back (a loop's own wake-up on a free slot)."""
        self._waiting.append(event)

    def take(self, count: int) -> None:
        self.in_use += count

    def give(self, count: int = 1) -> None:
        if count <= 0:
            return
        self.in_use -= count
        for event in self._waiting:
            event.set()

    def take_batch(self, cap: int, wanted: int) -> int:
        """Reserve up to ``wanted`` slots for batch runs, keeping every loop's together within
        ``cap`` (the process's batch share: each loop counting only its own runs would let batch
        runs fill every slot of a process with several homes); how many were reserved."""
        room = max(0, min(wanted, cap - self.batch_in_use))
        self.batch_in_use += room
        return room

    def settle_batch(self, reserved: int, claimed: int) -> None:
        """After a claim: ``claimed`` batch runs hold what ``reserved`` (from :meth:`take_batch`) kept
        for them (a claim under a cap may take batch runs beyond it: they are counted too)."""
        self.batch_in_use += claimed - reserved

    def give_batch(self) -> None:
        """A batch run ended."""
        self.batch_in_use -= 1
