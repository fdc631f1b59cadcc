"""Partition ownership for one node: renew, rebalance, and tell the node what it gained or lost."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

from chimes import metrics
from chimes.settings import PARTITION_LEASE_TTL_SEC
from chimes.store.scheduling import SchedulerStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LeaseConfig:
    ttl_sec: float = PARTITION_LEASE_TTL_SEC  # a dead node's partitions are taken over after at most this long
    renew_every_sec: float = 1.0  # well inside the TTL, so one slow round never loses a lease
    short_retry_sec: float = 0.1  # a round that took partitions but fewer than its share: the next one


class LeaseManager:
    """Holds this node's partitions. ``held`` maps partition id to fencing token.

    The in-memory map is what the node believes; the database decides. Every fire and every reap
    passes the tokens along and is refused for any partition whose token is no longer current.
    """

    def __init__(self, store: SchedulerStore, config: LeaseConfig,
                 on_lost: Callable[[set[int]], None] = lambda _: None, serves: frozenset[int] | None = None) -> None:
        self.store = store
        self.config = config
        self.held: dict[int, int] = {}
        self.short = False  # the last round left this node below its fair share
        # With shards: the partitions this node's home holds (the others' lease rows are empty here).
        self.serves = serves
        self._on_lost = on_lost
        self._hostname = socket.gethostname()

    async def sync(self) -> set[int]:
        """One round: heartbeat, renew, then shed or take partitions toward a fair share. Returns the
        partitions gained."""
        before = self.held
        round_ = await self.store.sync_leases(self._hostname, os.getpid(), before, self.config.ttl_sec)
        after = round_.held
        self.short = len(after) < round_.share
        lost = {p for p, token in before.items() if after.get(p) != token}
        gained = after.keys() - before.keys()
        self.held = after
        owned = len(after) if self.serves is None else len(after.keys() & self.serves)
        metrics.record_lease_round(self, owned, len(gained), len(lost))
        if lost:
            self._on_lost(lost)
        if lost or gained:
            log.info("partitions: %d held (+%d -%d)", len(after), len(gained), len(lost),
                     extra={"node_id": self.store.node_id})
        return set(gained)

    def drop_all(self) -> None:
        """Forget every lease locally (the database still fences writes); used when renewing fails."""
        if self.held:
            lost = set(self.held)
            self.held = {}
            metrics.record_partitions_owned(self, 0)
            self._on_lost(lost)

    async def release_all(self) -> None:
        self.held = {}
        metrics.record_partitions_owned(self, 0)
        await self.store.leave()
