"""What the worker's parts ask of the runs' database: each part is given a store that has what its
protocol names, so that a part can be handed another (a test's) rather than the database's own
:class:`~chimes.store.working.WorkerStore`, which has them all."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Protocol

from chimes.enums import Priority
from chimes.store.cap_slots import CapSlots
from chimes.store.caps import Cap
from chimes.store.db import Pool
from chimes.store.working import Admission, ClaimedRun, Completion


class ClaimStore(Protocol):
    """What the claim loop asks for: runs, under the caps or not."""

    @property
    def worker_id(self) -> str: ...

    async def claim(self, limit: int, lease_sec: float, deadline_grace_sec: float,
                    tiers: tuple[Priority, Priority] = ..., skip_owners: Sequence[str] = ...) -> list[ClaimedRun]: ...

    async def claim_given_caps(self, limit: int, lease_sec: float, deadline_grace_sec: float, caps: Sequence[Cap],
                               tiers: tuple[Priority, Priority] = ...,
                               skip_owners: Sequence[str] = ...) -> list[ClaimedRun]: ...

    async def claim_capped(self, limit: int, lease_sec: float, deadline_grace_sec: float, admit: Admission,
                           tiers: tuple[Priority, Priority] = ...) -> list[ClaimedRun]: ...

    async def claim_capped_with_slots(self, limit: int, lease_sec: float, deadline_grace_sec: float,
                                      admit: Admission, slots: CapSlots, shard_id: int | None,
                                      tiers: tuple[Priority, Priority] = ...) -> list[ClaimedRun]: ...

    async def caps_exist(self) -> bool: ...


class OutcomeStore(Protocol):
    """What the completer writes: outcomes, and the runs given up."""

    async def complete(self, completions: Sequence[Completion],
                       forget: Sequence[uuid.UUID] = ...) -> set[uuid.UUID]: ...

    async def give_up(self, runs: Sequence[ClaimedRun]) -> None: ...


class CallbackStore(Protocol):
    """What the keeper of cap slots asks: which runs that their targets run are still running."""

    async def still_running(self, runs: Sequence[ClaimedRun]) -> set[uuid.UUID]: ...


class HeartbeatStore(Protocol):
    """What the heartbeat writes: the worker's row, its leases, and the claims whose rows can go."""

    async def register(self, hostname: str, pid: int, concurrency: int, in_flight: int) -> None: ...

    async def extend_leases(self, runs: Sequence[ClaimedRun], lease_sec: float) -> set[uuid.UUID]: ...

    async def forget_claims(self, tokens: Sequence[uuid.UUID]) -> None: ...


class RunStore(ClaimStore, OutcomeStore, CallbackStore, HeartbeatStore, Protocol):
    """All a worker asks of its database: its parts' and, on starting and stopping, its own."""

    claims: Pool | None  # the claims' own pool, which the worker opens as it starts

    async def forget(self) -> None: ...

    async def release(self, runs: Sequence[ClaimedRun]) -> set[uuid.UUID]: ...
