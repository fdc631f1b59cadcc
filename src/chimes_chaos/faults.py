"""Faults: a schedule drawn from a seed, and the runner that injects it into a live fleet.

The schedule is computed up front from ``random.Random(seed)`` and the fleet's shape alone, never
from what happens during the run, so the same seed replays the same faults at the same offsets.
What really happened (when each fault started and ended, by the wall clock) is recorded as a
:class:`FaultWindow` for the invariant checker.
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass

from chimes_chaos.fleet import Fleet
from chimes_chaos.target import ChaosTarget

log = logging.getLogger(__name__)

# kind -> relative weight when drawing the next fault
WEIGHTS = {
    "kill_scheduler": 3.0,
    "freeze_scheduler": 2.0,  # SIGSTOP past its partition leases, then SIGCONT: a stale leader wakes up
    "kill_worker": 3.0,
    "freeze_worker": 2.0,  # SIGSTOP past its run leases: its runs are reaped while it sleeps
    "restart_postgres_fast": 0.6,
    "restart_postgres_immediate": 0.6,  # a crash of the database: no checkpoint, recovery on start
    "target_errors": 1.5,
    "target_hang": 1.5,
    "target_close": 1.5,
}
# With --ha (a Patroni cluster of the harness's own), instead of restarts of the one server:
HA_WEIGHTS = {
    "kill_postgres_primary": 2.5,  # SIGKILL the primary's PostgreSQL and Patroni; back (as a standby) later
    "switchover_postgres": 1.2,  # a planned switchover
    "freeze_postgres_primary": 1.0,  # SIGSTOP the primary past Patroni's TTL: a standby is promoted meanwhile
    "kill_postgres_etcd": 0.6,  # SIGKILL one etcd member (two of three keep the leader lock)
}
# With --zones (the cluster and the fleet spread over three zones in network namespaces), as well:
ZONE_WEIGHTS = {
    "cut_primary_zone": 1.2,  # the primary's zone off the network past Patroni's TTL and the lease TTL, healed
    "cut_other_zone": 0.8,  # a zone without the primary (a standby's, or the one without PostgreSQL)
}
ZONE_CUT_SEC = (24.0, 32.0)
# With --shards N > 1 (a catalog and N-1 shard servers of the harness's own), as well:
SHARD_WEIGHTS = {
    # One shard's PostgreSQL SIGSTOPped past the lease TTL and the run lease, then resumed: the other
    # homes must go on firing and starting on time (the blast radius), the stopped one catch up.
    "stop_postgres_shard": 1.2,
}
SHARD_STOP_PAST_LEASES_SEC = (2.0, 8.0)  # stopped this long past the lease TTL plus the run lease
# Faults after which a new primary is expected (their windows record when it was seen).
PRIMARY_MOVES = frozenset({"kill_postgres_primary", "switchover_postgres", "freeze_postgres_primary",
                           "cut_primary_zone"})
PRIMARY_DOWN_SEC = (25.0, 35.0)  # a killed primary comes back after this long: past Patroni's TTL (20 s)
DATABASE_COOLDOWN_SEC = 20.0  # between database restarts, so outages never add up to a missed fire
RECOVERED_SEC = 2.0  # a victim stays healthy at least this long before it is hit again


@dataclass(frozen=True, slots=True)
class PlannedFault:
    at: float  # seconds after the fault phase starts
    kind: str
    victim: str | None  # the fleet member hit, for process faults
    duration: float  # seconds it stays down, frozen or misbehaving (0 for a database restart)


@dataclass(slots=True)
class FaultWindow:
    kind: str
    victim: str | None
    started: float  # epoch seconds
    ended: float | None = None
    note: str = ""
    promoted: float | None = None  # a fault that moves the primary: when the new one was first seen running

    @property
    def stopped_home(self) -> int | None:
        """The home (1..N-1) a shard stop stopped; None for every other fault (they hit every home)."""
        if self.kind == "stop_postgres_shard" and self.victim and self.victim.startswith("shard-"):
            return int(self.victim.removeprefix("shard-"))
        return None

    @property
    def hits(self) -> str:
        """What the fault hits: ``scheduler``, ``worker``, ``postgres``, ``target``, or ``zone`` (all
        of a zone's processes and servers at once)."""
        return next(what for what in ("zone", "scheduler", "worker", "postgres", "target") if what in self.kind)


def _shares_database(kind: str) -> bool:
    """Database faults and zone cuts never overlap: each is survivable alone, as the design promises."""
    return "postgres" in kind or "zone" in kind


def plan_faults(seed: int | str, duration: float, *, schedulers: Sequence[str], workers: Sequence[str],
                lease_ttl: float, worker_lease: float, mean_gap: float, database: bool,
                ha: bool = False, zones: bool = False, shards: int = 1) -> list[PlannedFault]:
    """Faults for ``duration`` seconds, about one every ``mean_gap`` seconds. At least one scheduler
    and one worker are always left untouched; database restarts only with ``database``, failovers
    only with ``ha``, zone cuts only with ``zones``, shard stops only with ``shards`` > 1. Database
    faults (a shard stop among them) never overlap."""
    rng = random.Random(f"{seed}-faults")
    table = {k: w for k, w in WEIGHTS.items() if database or "postgres" not in k} | (HA_WEIGHTS if ha else {})
    table |= ZONE_WEIGHTS if zones else {}
    table |= SHARD_WEIGHTS if shards > 1 and database else {}
    kinds = list(table)
    weights = [table[k] for k in kinds]
    free_at: dict[str, float] = {}  # victim (or "postgres", "target") -> when it may be hit again
    planned: list[PlannedFault] = []
    at = rng.expovariate(1 / mean_gap)
    while at < duration - 1:
        kind = rng.choices(kinds, weights)[0]
        fault = _draw(rng, kind, at, free_at, schedulers, workers, lease_ttl, worker_lease)
        if fault is not None and fault.at + fault.duration < duration:
            planned.append(fault)
            key = fault.victim or ("postgres" if _shares_database(kind) else "target")
            cooldown = DATABASE_COOLDOWN_SEC if key == "postgres" else RECOVERED_SEC
            free_at[key] = fault.at + fault.duration + cooldown
        at += rng.expovariate(1 / mean_gap)
    return planned


def _draw(rng: random.Random, kind: str, at: float, free_at: dict[str, float], schedulers: Sequence[str],
          workers: Sequence[str], lease_ttl: float, worker_lease: float) -> PlannedFault | None:
    if _shares_database(kind) or kind.startswith("target"):
        key = "postgres" if _shares_database(kind) else "target"
        if free_at.get(key, 0.0) > at:
            return None
        if kind == "stop_postgres_shard":
            return PlannedFault(at, kind, None, round(lease_ttl + worker_lease
                                                      + rng.uniform(*SHARD_STOP_PAST_LEASES_SEC), 2))
        return PlannedFault(at, kind, None, round(_database_fault_length(rng, kind), 2))
    members = schedulers if kind.endswith("scheduler") else workers
    healthy = [m for m in members if free_at.get(m, 0.0) <= at]
    if len(healthy) < 2:  # never the last healthy one: losing *any* node must be survivable
        return None
    victim = rng.choice(healthy)
    if kind.startswith("kill"):
        duration = rng.uniform(0.5, 5.0)
    elif kind == "freeze_scheduler":
        duration = rng.uniform(lease_ttl + 1, lease_ttl + 4)
    else:
        duration = rng.uniform(worker_lease + 1, worker_lease + 4)
    return PlannedFault(at, kind, victim, round(duration, 2))


def _database_fault_length(rng: random.Random, kind: str) -> float:
    if kind == "kill_postgres_primary":
        return rng.uniform(*PRIMARY_DOWN_SEC)
    if kind == "freeze_postgres_primary":
        return rng.uniform(22.0, 28.0)
    if kind == "kill_postgres_etcd":
        return rng.uniform(3.0, 10.0)
    if "zone" in kind:
        return rng.uniform(*ZONE_CUT_SEC)
    if kind.startswith("target"):
        return rng.uniform(2, 8)
    return 0.0  # a restart or a switchover: over when it is done


class FaultRunner:
    """Injects a planned schedule into the fleet and the target, recording each fault's window."""

    def __init__(self, plan: Sequence[PlannedFault], fleet: Fleet, target: ChaosTarget) -> None:
        self.plan = list(plan)
        self.fleet = fleet
        self.target = target
        self.windows: list[FaultWindow] = []

    async def run(self) -> None:
        start = time.monotonic()
        injections: list[asyncio.Task[None]] = []
        for fault in self.plan:
            await asyncio.sleep(max(0.0, start + fault.at - time.monotonic()))
            injections.append(asyncio.create_task(self._inject(fault)))
        await asyncio.gather(*injections)

    async def _inject(self, fault: PlannedFault) -> None:
        window = FaultWindow(fault.kind, fault.victim, time.time())
        self.windows.append(window)
        log.info("fault: %s %s for %.1fs", fault.kind, fault.victim or self._victim_of(fault), fault.duration)
        try:
            await self._apply(fault, window)
        finally:
            window.ended = time.time()

    async def _apply(self, fault: PlannedFault, window: FaultWindow) -> None:
        if fault.kind in HA_WEIGHTS or fault.kind in ZONE_WEIGHTS:  # first: not a kill of a fleet member
            try:
                await self._failover(fault, window)
            except Exception as exc:  # recorded, and the run goes on: the checker will show the damage
                window.note = f"{fault.kind} failed: {exc}"
                log.error("%s failed: %s", fault.kind, exc)
        elif fault.kind.startswith("kill"):
            member = self.fleet.members[fault.victim or ""]
            member.kill()
            await asyncio.sleep(fault.duration)
            member.start()
        elif fault.kind.startswith("freeze"):
            member = self.fleet.members[fault.victim or ""]
            member.freeze()
            await asyncio.sleep(fault.duration)
            member.thaw()
        elif fault.kind == "stop_postgres_shard":
            await self._stop_shard(fault, window)
        elif fault.kind.startswith("restart_postgres"):
            mode = fault.kind.rsplit("_", 1)[1]
            try:
                await asyncio.to_thread(self.fleet.restart_database, mode)
            except Exception as exc:  # recorded, and the run goes on: the checker will show the damage
                window.note = f"restart failed: {exc}"
                log.error("database restart (%s) failed: %s", mode, exc)
        else:
            self.target.mode = fault.kind.split("_", 1)[1]
            await asyncio.sleep(fault.duration)
            self.target.mode = "normal"

    def _shard_of(self, fault: PlannedFault) -> int:
        return 1 + int(fault.at * 1000) % max(1, len(self.fleet.shard_servers))

    def _victim_of(self, fault: PlannedFault) -> str:
        return f"shard-{self._shard_of(fault)}" if fault.kind == "stop_postgres_shard" else ""

    async def _stop_shard(self, fault: PlannedFault, window: FaultWindow) -> None:
        """SIGSTOP one shard's PostgreSQL (never the catalog's: the restarts hit that one) for the
        fault's length, then SIGCONT. Which shard follows from the plan, as the etcd member does."""
        home = self._shard_of(fault)
        window.victim = f"shard-{home}"
        try:
            self.fleet.stop_shard(home)
        except Exception as exc:  # recorded, and the run goes on: the checker will show the damage
            window.note = f"stopping shard-{home} failed: {exc}"
            log.error("stopping shard-%d failed: %s", home, exc)
            return
        try:
            await asyncio.sleep(fault.duration)
        finally:
            self.fleet.stop_shard(home, False)

    async def _failover(self, fault: PlannedFault, window: FaultWindow) -> None:
        """The faults of a Patroni cluster (chimes.ha): the primary killed, frozen or moved, etcd hit,
        a zone cut off."""
        cluster = self.fleet.cluster
        assert cluster is not None
        if fault.kind == "switchover_postgres":
            new = await asyncio.to_thread(cluster.switchover)
            window.promoted = time.time()
            window.victim = new.name
            return
        if fault.kind == "kill_postgres_etcd":
            member = cluster.etcd[int(fault.at * 1000) % len(cluster.etcd)]
            window.victim = member.name
            member.signal(signal.SIGKILL)
            await asyncio.sleep(fault.duration)
            member.start()
            return
        primary = await asyncio.to_thread(cluster.wait_for_primary, 60)
        timeline = (await asyncio.to_thread(primary.state) or {}).get("timeline", 0)
        window.victim = primary.name
        if fault.kind in ZONE_WEIGHTS:
            await self._cut_zone(fault, window, primary.layout.host, timeline)
        elif fault.kind == "kill_postgres_primary":
            primary.kill()
            promotion = asyncio.create_task(self._promotion(window, timeline, fault.duration + 60))
            await asyncio.sleep(fault.duration)
            primary.start()
            await promotion
        else:
            primary.freeze()
            # Frozen only just past the TTL, the primary may wake before a standby is promoted.
            promotion = asyncio.create_task(self._promotion(window, timeline, fault.duration + 10, required=False))
            await asyncio.sleep(fault.duration)
            primary.freeze(False)
            await promotion

    async def _cut_zone(self, fault: PlannedFault, window: FaultWindow, primary_host: str, timeline: int) -> None:
        zones = self.fleet.zones
        assert zones is not None
        primary_zone = zones.zone_of(primary_host)
        others = [z for z in range(1, zones.count + 1) if z != primary_zone]
        zone = primary_zone if fault.kind == "cut_primary_zone" else others[int(fault.at * 1000) % len(others)]
        window.victim = f"zone-{zone}"
        zones.cut(zone)
        promotion = (asyncio.create_task(self._promotion(window, timeline, fault.duration + 60))
                     if zone == primary_zone else None)
        try:
            await asyncio.sleep(fault.duration)
        finally:
            zones.heal(zone)
        if promotion is not None:
            await promotion

    async def _promotion(self, window: FaultWindow, timeline: int, within: float, required: bool = True) -> None:
        """Record when a primary newer than ``timeline`` is first seen running (Patroni's REST API,
        polled every 0.1 s); without one within ``within`` seconds the fault is noted as failed."""
        cluster = self.fleet.cluster
        assert cluster is not None
        try:
            await asyncio.to_thread(cluster.wait_for_primary, within, after_timeline=timeline)
            window.promoted = time.time()
        except TimeoutError:
            if required:
                window.note = f"no new primary within {within:.0f} s"
                log.error("%s: no new primary within %.0f s", window.kind, within)
            else:
                log.info("%s: the primary woke up before a standby was promoted", window.kind)
