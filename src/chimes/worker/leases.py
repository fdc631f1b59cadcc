"""The lease rows of a worker's claims: a claim's runs share one row (claim_leases), which can go once
none of them is left in the worker's hands."""

from __future__ import annotations

import uuid

from chimes.store.working import ClaimedRun


class ClaimLeases:
    def __init__(self) -> None:
        # The runs of each claim still in this worker's hands, by the claim's lease token; the claim
        # loop adds to it directly, as it does for every run it claims.
        self.claims: dict[uuid.UUID, set[uuid.UUID]] = {}
        self._forget: list[uuid.UUID] = []  # the claims none are left of, whose rows the next write deletes

    def settle(self, run: ClaimedRun) -> None:
        """``run`` left this worker's hands (recorded, refused, cancelled, taken away, handed back or
        given up): once none of its claim is left, the claim's lease row can go."""
        left = self.claims.get(run.lease_token)
        if left is None:
            return
        left.discard(run.run_id)
        if not left:
            del self.claims[run.lease_token]
            self._forget.append(run.lease_token)

    def take_forgotten(self) -> list[uuid.UUID]:
        """The claims whose rows are to be deleted, handed to the write that deletes them."""
        forget, self._forget = self._forget, []
        return forget

    def forget_later(self, forget: list[uuid.UUID]) -> None:
        """The write that was to delete their rows failed: the next one tries again."""
        self._forget[:0] = forget
