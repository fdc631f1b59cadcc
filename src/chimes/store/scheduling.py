"""What a scheduler node asks of the database, in domain terms: leases, due triggers, fires, reaping."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from chimes import __version__
from chimes.enums import TriggerKind
from chimes.ids import PARTITION_COUNT, scheduled_at_of
from chimes.schedules import Recurrence, recurrence_of
from chimes.slots import Slot
from chimes.store.db import ROLE_COMMAND_TIMEOUT_SEC, Conn, Row, one_row, open_connection
from chimes.store.queries import bind, sql
from chimes.store.working import ANY_OWNER, queued_payload, runs_ended
from chimes.timeouts import wait_event

# A batch fired ahead whose time the database's clock has not reached when the node's clock says it has
# (the node follows the database's clock as measured; a measurement can be off) asks again after this.
FIRE_AHEAD_RECHECK_SEC = 0.002
MIN_START_DEADLINE = timedelta(seconds=1)  # the smallest startDeadlineSec a job may have
TriggerKey = tuple[int, datetime, uuid.UUID]  # (partition_id, fire_at, trigger_id): the primary key
# partition -> (how many triggers, the sum of their fire times in microseconds since the epoch)
TriggerSums = dict[int, tuple[int, int]]


ALL_PARTITIONS = list(range(PARTITION_COUNT))


@dataclass(frozen=True, slots=True)
class LeaseRound:
    """What a lease round left a node with: the partitions it holds, with their fencing tokens, and how
    many it should hold (its fair share of the live nodes)."""

    held: dict[int, int]
    share: int


@dataclass(frozen=True, slots=True)
class DueTrigger:
    """A trigger read by the due scan, with what the node needs of its job to fire it."""

    partition_id: int
    fire_at: datetime
    trigger_id: uuid.UUID
    job_id: uuid.UUID
    job_version: int
    kind: TriggerKind
    cron: str | None
    timezone: str | None
    dst_gap: str | None = None
    dst_fold: str | None = None
    jitter_sec: int = 0
    catch_up: dict[str, Any] | None = None
    paused_at: datetime | None = None
    resumed_at: datetime | None = None
    start_deadline_sec: int | None = None  # the job's; None: not read (a retry trigger)
    every_sec: int | None = None
    phase_sec: int | None = None
    start_at: datetime | None = None
    end_at: datetime | None = None
    max_runs: int | None = None  # the job's schedule.maxRuns
    slots_fired: int = 0  # its slots recorded so far, counted for max_runs
    owner: str | None = None
    exclude_calendars: Sequence[str] | None = None  # names of the owner's calendars
    concurrency: str | None = None  # the job's concurrency policy; None: not read (a retry trigger)
    paused: bool = False
    # An edit or a pause that found this trigger due and not fired kept it for the slots of the
    # definition before it, due up to carried_until: carried_slots (None: the walk of the job's
    # schedule up to then), and carried_unrecorded older ones left out (services.jobs).
    carried_until: datetime | None = None
    carried_slots: Sequence[datetime] | None = None
    carried_unrecorded: int = 0

    @property
    def kept(self) -> bool:
        """Whether this is a trigger an edit or a pause kept for the slots due before it."""
        return (self.kind == TriggerKind.SCHEDULE and self.carried_until is not None
                and self.fire_at <= self.carried_until)

    @property
    def remaining_runs(self) -> int | None:
        return None if self.max_runs is None else self.max_runs - self.slots_fired

    @property
    def key(self) -> TriggerKey:
        return (self.partition_id, self.fire_at, self.trigger_id)

    @property
    def recurrence(self) -> Recurrence | None:
        """The job's recurring schedule; None for a one-off job or a retry."""
        return recurrence_of(self.cron, self.timezone, dst_gap=self.dst_gap, dst_fold=self.dst_fold,
                             every_sec=self.every_sec, phase_sec=self.phase_sec, start_at=self.start_at,
                             end_at=self.end_at)


PARTITIONS_CHANNEL = "chimes_partitions_released"  # the payload: the node that released them


class PartitionSignals:
    """A connection of its own on which a scheduler node LISTENs for partitions other nodes released
    as they stopped (PARTITIONS_CHANNEL)."""

    def __init__(self, dsn: str, node_id: str, on_released: Callable[[], None]) -> None:
        self._dsn, self._node_id, self._on_released = dsn, node_id, on_released
        self._conn: asyncpg.Connection | None = None
        self._lost = asyncio.Event()

    async def __aenter__(self) -> PartitionSignals:
        conn = await open_connection(self._dsn, command_timeout=ROLE_COMMAND_TIMEOUT_SEC)
        try:
            conn.add_termination_listener(lambda _: self._lost.set())
            await conn.add_listener(PARTITIONS_CHANNEL, self._heard)
        except BaseException:
            conn.terminate()
            raise
        self._conn = conn
        self._on_released()  # whatever was released while nobody listened
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._conn is not None and not self._conn.is_closed():
            self._conn.terminate()  # never a wait: the server may be the one that stopped answering

    def _heard(self, _conn: object, _pid: int, _channel: str, payload: object) -> None:
        if payload != self._node_id:
            self._on_released()

    async def alive(self, check_every_sec: float) -> bool:
        """Wait up to ``check_every_sec``; then a round trip, bounded, shows the connection still
        answers. False once it is lost."""
        if await wait_event(self._lost, check_every_sec):
            return False
        assert self._conn is not None
        await self._conn.execute(sql("listen_partitions"))
        return not self._lost.is_set()


def due_trigger(row: Row) -> DueTrigger:
    """A trigger read by name from a row of the due scan (``scan_due_triggers``, ``due_triggers_by_key``)."""
    fields = dict(row)
    fields["kind"] = TriggerKind(fields["kind"])
    return DueTrigger(**fields)


@dataclass(frozen=True, slots=True)
class Fire:
    """A due trigger ready to fire: the runs it makes (one per slot) and where the schedule goes next."""

    trigger: DueTrigger
    run_id: uuid.UUID
    scheduled_at: datetime
    next_fire_at: datetime | None
    slots: tuple[Slot, ...] = ()
    accounted: int = 0  # the slots this fire went through, recorded or counted in a note: a run cap counts them


@dataclass(frozen=True, slots=True)
class FireResult:
    leases_held: int
    fired: int
    enqueued: int
    too_early: int = 0  # sent before their time by the database's clock; they fire after the next scan


@dataclass(frozen=True, slots=True)
class ClockSample:
    """The database's clock, read between two readings of a node's own (seconds since the epoch)."""

    sent: float
    database: float
    received: float


@dataclass(frozen=True, slots=True)
class LostRun:
    """A running run whose lease expired or that ran past its deadline, and how the reaper ends it."""

    run_id: uuid.UUID
    scheduled_at: datetime
    lease_token: uuid.UUID
    worker_id: str | None
    started_at: datetime | None
    error: str
    retry_at: datetime | None  # None: fail for good; now or earlier: re-enqueue at once; later: retry then
    lease_lost: bool = True  # the worker vanished (counts toward poison), rather than overran its deadline


@dataclass(frozen=True, slots=True)
class ExpiredRun:
    """A running run whose worker stopped heartbeating (``lease_expired``) or that ran past its deadline."""

    run_id: uuid.UUID
    scheduled_at: datetime
    job_id: uuid.UUID
    attempt: int
    lease_token: uuid.UUID
    partition_id: int
    priority: int
    worker_id: str | None
    started_at: datetime | None
    job_version: int
    deadline_at: datetime | None
    lease_losses: int | None
    lease_expired: bool | None  # None: no lease time (never so for a running run)
    retry_policy: dict[str, Any] | None  # None: the job was deleted


class SchedulerStore:
    def __init__(self, pool: asyncpg.Pool, node_id: str) -> None:
        self._pool = pool
        self.node_id = node_id

    # --- membership and leases -------------------------------------------------------------
    async def sync_leases(
        self, hostname: str, pid: int, held: Mapping[int, int], ttl_sec: float, release_extra: bool = True
    ) -> LeaseRound:
        """One lease round: heartbeat, renew what is held, then give up or take partitions until this
        node holds its fair share of the live nodes. Returns the partitions held, with their tokens,
        and that share."""
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(sql("heartbeat_node"), self.node_id, hostname, pid, __version__)
            live = [r["node_id"] for r in await conn.fetch(sql("live_nodes"), ttl_sec)]
            renewed = await conn.fetch(
                sql("renew_leases"), self.node_id, list(held), list(held.values()), ttl_sec
            )
            owned = {r["partition_id"]: r["token"] for r in renewed}
            target = fair_share(live, self.node_id)
            if len(owned) > target and release_extra:
                extra = sorted(owned)[target:]
                await conn.execute(sql("release_leases"), self.node_id, extra)
                await conn.execute(sql("notify_partitions_released"), self.node_id)  # a node joined: to it
                for partition in extra:
                    del owned[partition]
            elif len(owned) < target:
                taken = await conn.fetch(sql("acquire_leases"), self.node_id, target - len(owned), ttl_sec)
                owned.update((r["partition_id"], r["token"]) for r in taken)
        return LeaseRound(owned, target)

    async def clock_sample(self, local_time: Callable[[], float]) -> ClockSample:
        """Read the database's clock between two readings of ``local_time`` on one connection."""
        async with self._pool.acquire() as conn:
            sent = local_time()
            database = await conn.fetchval(sql("database_time"))
            received = local_time()
        return ClockSample(sent, float(database), received)

    async def leave(self) -> None:
        """Clean shutdown: hand every partition this node owns back at once, and tell the other nodes
        (at commit), so that they take them over without waiting for their next lease round. Every
        one the database says is its own, not only those it knows of: a lease round cut short by the
        stop may have renewed or taken some it never heard back about."""
        async with self._pool.acquire() as conn, conn.transaction():
            released = await conn.fetch(sql("release_leases"), self.node_id, ALL_PARTITIONS)
            await conn.execute(sql("forget_node"), self.node_id)
            if released:
                await conn.execute(sql("notify_partitions_released"), self.node_id)

    async def forget_dead_nodes(self) -> None:
        await self._pool.execute(sql("forget_dead_nodes"))

    # --- triggers --------------------------------------------------------------------------
    async def scan_due(self, partitions: Sequence[int], until: datetime, limit: int,
                       after: datetime | None = None) -> list[DueTrigger]:
        """The triggers due before ``until`` (and from ``after`` on, when given), with their jobs."""
        rows = await self._pool.fetch(sql("scan_due_triggers"), list(partitions), until, limit, after)
        return [due_trigger(row) for row in rows]

    async def scan_due_keys(self, partitions: Sequence[int], before: datetime, limit: int) -> list[TriggerKey]:
        """Only the keys of the triggers due before ``before``."""
        rows = await self._pool.fetch(sql("scan_due_keys"), list(partitions), before, limit)
        return [(row[0], row[1], row[2]) for row in rows]

    async def due_trigger_sums(self, partitions: Sequence[int], before: datetime) -> TriggerSums:
        """Per partition, how many triggers are due before ``before`` and the sum of their fire times
        in microseconds since the epoch."""
        rows = await self._pool.fetch(sql("due_trigger_sums"), list(partitions), before)
        return {row[0]: (row[1], int(row[2] * 1_000_000)) for row in rows}

    async def due_triggers(self, keys: Sequence[TriggerKey]) -> list[DueTrigger]:
        """The triggers with these keys that still exist, with their jobs."""
        rows = await self._pool.fetch(sql("due_triggers_by_key"), [k[0] for k in keys], [k[1] for k in keys],
                                      [k[2] for k in keys])
        return [due_trigger(row) for row in rows]

    async def fire(self, leases: Mapping[int, int], fires: Sequence[Fire], fired_at: datetime) -> FireResult:
        """Fire one batch in one transaction, fenced by this node's lease tokens."""
        async with self._pool.acquire() as conn, conn.transaction():
            row = await self._fire_in(conn, leases, fires, fired_at, 0.0)
            if row["replacing"]:
                await _replace_active_runs(conn, fires, row["replacing"])
            await self._notify_late_fires(conn, fires, fired_at)
        return FireResult(row["leases_held"], row["fired"], row["enqueued"], row["too_early"])

    async def fire_ahead(self, leases: Mapping[int, int], fires: Sequence[Fire], due_at: datetime,
                         ahead_sec: float, until_due: Callable[[], Awaitable[None]]) -> FireResult | None:
        """Fire a batch up to ``ahead_sec`` before ``due_at``, the latest fire time in it, and commit it
        at that time: the statement's work is done before the second it is due, and what it writes is
        seen by no one (workers, the API) until then. A job changed or deleted meanwhile, or a lease
        lost, or a job's runs still active changed (those its concurrency policy decided by), rolls the
        batch back (None): the caller fires it the ordinary way. Only for the triggers
        ``firing.fires_ahead`` allows."""
        lease_ids = _held_partitions(leases, fires)
        jobs = {f.trigger.job_id: f.trigger.job_version for f in fires}
        async with self._pool.acquire() as conn:
            tx = conn.transaction()
            await tx.start()
            try:
                row = await self._fire_in(conn, leases, fires, due_at, ahead_sec)
                text, args = bind("confirm_fire_ahead", due_at=due_at, held_partition_id=lease_ids,
                                  held_token=[leases[p] for p in lease_ids], node_id=self.node_id,
                                  fired_job_id=list(jobs), fired_version=list(jobs.values()),
                                  decided_job_id=row["decided_jobs"] or [],
                                  decided_running=row["decided_running"] or [],
                                  decided_held=row["decided_held"] or [])
                confirm = (text, *args)
                await until_due()
                give_up = time.monotonic() + ahead_sec
                while True:
                    confirmed = one_row(await conn.fetchrow(*confirm))
                    if confirmed["due"] or time.monotonic() > give_up:
                        break
                    await asyncio.sleep(FIRE_AHEAD_RECHECK_SEC)
                if not (confirmed["due"] and confirmed["leases_held"] and confirmed["jobs_unchanged"]
                        and confirmed["policies_unchanged"]) or row["replacing"]:
                    await tx.rollback()
                    return None
            except BaseException:
                await tx.rollback()
                raise
            await tx.commit()
        return FireResult(row["leases_held"], row["fired"], row["enqueued"], row["too_early"])

    async def _fire_in(self, conn: Conn, leases: Mapping[int, int], fires: Sequence[Fire], fired_at: datetime,
                       ahead_sec: float) -> Row:
        """The fire statement, and the queue's NOTIFY (sent at the transaction's commit)."""
        lease_ids = _held_partitions(leases, fires)
        text, args = bind("fire_triggers", held_partition_id=lease_ids, held_token=[leases[p] for p in lease_ids],
                          node_id=self.node_id, fired_at=fired_at, ahead_sec=ahead_sec,
                          **_trigger_arrays(fires), **_slot_arrays(fires), **_counted_arrays(fires))
        row = one_row(await conn.fetchrow(text, *args))
        if row["enqueued"]:
            await conn.execute(sql("notify_queue"), queued_payload(f.trigger.owner for f in fires))
        return row

    async def _notify_late_fires(self, conn: Conn, fires: Sequence[Fire], fired_at: datetime) -> None:
        """A run created later than its job's start deadline has missed its start, however soon a
        worker takes it: notified here, in the fire's transaction. On time, or late but within the
        deadline (the usual case, also in a burst that takes seconds to fire), no query."""
        late = late_slots(fires, fired_at)
        if late:
            await conn.execute(sql("notify_late_fires"), [s.run_id for s in late], [s.scheduled_at for s in late])

    # --- reaper ----------------------------------------------------------------------------
    async def expired_runs(self, partitions: Sequence[int], limit: int) -> list[ExpiredRun]:
        return [ExpiredRun(**dict(row)) for row in await self._pool.fetch(sql("expired_runs"), list(partitions), limit)]

    async def reap(self, leases: Mapping[int, int], lost: Sequence[LostRun], planned_at: datetime) -> Sequence[Row]:
        """End the lost attempts, whose retries were planned at ``planned_at`` (the node's clock);
        returns the runs ended or re-enqueued (run_id, scheduled_at, job_id, partition_id,
        job_version, priority, retry_at, final)."""
        partitions = list(leases)
        async with self._pool.acquire() as conn, conn.transaction():
            text, args = bind(
                "reap_runs", held_partition_id=partitions, held_token=[leases[p] for p in partitions],
                node_id=self.node_id, planned_at=planned_at,
                lost_run_id=[r.run_id for r in lost], lost_scheduled_at=[r.scheduled_at for r in lost],
                lost_lease_token=[r.lease_token for r in lost], lost_error=[r.error for r in lost],
                lost_retry_at=[r.retry_at for r in lost], lost_worker_id=[r.worker_id for r in lost],
                lost_started_at=[r.started_at for r in lost], lost_lease_lost=[r.lease_lost for r in lost],
            )
            ended = await conn.fetch(text, *args)
            if any(r["retry_at"] is not None for r in ended):
                await conn.execute(sql("notify_queue"), ANY_OWNER)
            await runs_ended(conn, [r for r in ended if r["final"]])
        return ended

    async def reconcile_active_runs(self) -> tuple[int, int]:
        """Self-healing for concurrency bookkeeping; cheap, as only unfinished runs are looked at.
        Returns how many ended runs were forgotten and how many held runs were released."""
        row = one_row(await self._pool.fetchrow(sql("reconcile_active_runs")))
        return row["forgotten"], row["released"]

    async def forget_dead_claims(self) -> int:
        """Delete the lease rows of claims whose worker is gone and whose runs all ended; returns how many."""
        status = await self._pool.execute(sql("forget_dead_claims"))
        return int(status.split()[-1])


async def _replace_active_runs(conn: Conn, fires: Sequence[Fire], new_runs: Sequence[uuid.UUID]) -> None:
    """concurrency replace: the fire made ``new_runs`` while other runs of their jobs were active; those
    are cancelled in the fire's transaction, and the workers running them told at its commit."""
    job_of = {s.run_id: f.trigger.job_id for f in fires for s in f.slots}
    slot_of = {run_id: scheduled_at_of(run_id).isoformat().replace("+00:00", "Z") for run_id in new_runs}
    reasons = [f"replaced by the run of {slot_of[run_id]} (concurrency replace)" for run_id in new_runs]
    ended = await conn.fetch(sql("replace_active_runs"), list(new_runs), [job_of[r] for r in new_runs], reasons)
    await runs_ended(conn, ended)
    running = [str(r["run_id"]) for r in ended if r["was_running"]]
    if running:
        await conn.execute(sql("notify_cancels"), running)


def late_slots(fires: Sequence[Fire], fired_at: datetime) -> list[Slot]:
    """The slots fired past their job's start deadline (plus its jitter), as ``notify_late_fires``
    judges them: the deadline is the one the scan read with the trigger, of the job version the
    fire checks. Where it was not read, every slot more than the smallest deadline late."""
    late = []
    for f in fires:
        deadline = f.trigger.start_deadline_sec
        allowed = MIN_START_DEADLINE if deadline is None else timedelta(seconds=deadline + f.trigger.jitter_sec)
        late += [s for s in f.slots if s.outcome != "skip" and fired_at - s.scheduled_at > allowed]
    return late


def _held_partitions(leases: Mapping[int, int], fires: Sequence[Fire]) -> list[int]:
    """The partitions of a batch whose lease the node holds, as the fire statement and its
    confirmation name them."""
    return [p for p in {f.trigger.partition_id for f in fires} if p in leases]


# The batch as the arrays fire_triggers unnests, one group each: a group's arrays, named after the
# columns the statement unnests them into, hold one entry per trigger (per slot, per capped job).
def _trigger_arrays(fires: Sequence[Fire]) -> dict[str, list[Any]]:
    triggers = [f.trigger for f in fires]
    return {
        "trigger_idx": list(range(len(fires))),
        "trigger_partition_id": [t.partition_id for t in triggers],
        "trigger_fire_at": [t.fire_at for t in triggers],
        "trigger_trigger_id": [t.trigger_id for t in triggers],
        "trigger_job_id": [t.job_id for t in triggers],
        "trigger_job_version": [t.job_version for t in triggers],
        "trigger_kind": [t.kind for t in triggers],
        "trigger_run_id": [f.run_id for f in fires],
        "trigger_scheduled_at": [f.scheduled_at for f in fires],
        "trigger_next_fire_at": [f.next_fire_at for f in fires],
    }


def _slot_arrays(fires: Sequence[Fire]) -> dict[str, list[Any]]:
    """``slot_idx``: the index of its fire's trigger in the batch."""
    slots = [s for f in fires for s in f.slots]
    return {
        "slot_idx": [index for index, f in enumerate(fires) for _ in f.slots],
        "slot_run_id": [s.run_id for s in slots],
        "slot_scheduled_at": [s.scheduled_at for s in slots],
        "slot_trigger": [s.trigger for s in slots],
        "slot_outcome": [s.outcome for s in slots],
        "slot_reason": [s.reason for s in slots],
    }


def _counted_arrays(fires: Sequence[Fire]) -> dict[str, list[Any]]:
    """The jobs with a run cap, and how many slots this batch records for each."""
    counted = [f for f in fires if f.trigger.max_runs is not None and f.accounted]
    return {
        "counted_job_id": [f.trigger.job_id for f in counted],
        "counted_slots": [f.accounted for f in counted],
    }


def fair_share(live_nodes: Sequence[str], node_id: str, partitions: int = 1024) -> int:
    """How many partitions this node should hold: an even split, the remainder to the first nodes."""
    nodes = sorted(set(live_nodes) | {node_id})
    index = nodes.index(node_id)
    base, extra = divmod(partitions, len(nodes))
    return base + (1 if index < extra else 0)
