"""What a worker asks of the database: claim runs, keep their leases, record their outcomes."""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple, Protocol

import asyncpg
import orjson

from chimes import __version__
from chimes.enums import Priority, RunStatus
from chimes.settings import RUN_TIMEOUT_SEC
from chimes.store.cap_slots import CapSlots, full_caps, rooms_of
from chimes.store.caps import Candidate, Cap, CapKey, caps_of
from chimes.store.db import DB_ERRORS, ROLE_COMMAND_TIMEOUT_SEC, Conn, command_timeout, create_pool, open_connection
from chimes.store.queries import bind, sql

#: The admission policy of a capped claim (chimes.worker.caps.admit): from the candidates in queue
#: order, the room left under each cap, and how many to take at most, the queue ids to claim.
Admission = Callable[[Iterable[Candidate], Mapping[CapKey, int], int], list[int]]

log = logging.getLogger(__name__)

QUEUE_CHANNEL = "chimes_run_queue"  # payload: whose runs were queued (queued_payload)
CANCEL_CHANNEL = "chimes_run_cancel"  # payload: the id of a running run that was just cancelled
ANY_OWNER = ""  # a queue NOTIFY's payload when the owners of the runs are not known
_MAX_PAYLOAD_BYTES = 4000  # of PostgreSQL's 8000; beyond, the owners are not listed


def queued_payload(owners: Iterable[str | None]) -> str:
    """A queue NOTIFY's payload: the owners whose runs were queued, as a JSON array, or ANY_OWNER when
    one is not known (None) or they are too many to list."""
    found = set(owners)
    if not found or None in found:
        return ANY_OWNER
    payload = orjson.dumps(sorted(o for o in found if o is not None)).decode()
    return payload if len(payload.encode()) <= _MAX_PAYLOAD_BYTES else ANY_OWNER


def queued_owners(payload: str) -> frozenset[str] | None:
    """The owners a queue NOTIFY names; None: any owner (ANY_OWNER, or a payload this version cannot
    read, from another release of the scheduler)."""
    try:
        owners = orjson.loads(payload) if payload else None
    except orjson.JSONDecodeError:
        return None
    if not isinstance(owners, list) or not all(isinstance(o, str) for o in owners):
        return None
    return frozenset(owners)


class ClaimedRun(NamedTuple):
    """A run this worker claimed, as the claim statements return it. A named tuple rather than a
    frozen dataclass: one is made per run claimed, and a frozen dataclass sets each of its fields
    through ``object.__setattr__``, which costs several times as much."""

    run_id: uuid.UUID
    scheduled_at: datetime
    job_id: uuid.UUID
    attempt: int
    lease_token: uuid.UUID
    started_at: datetime
    trigger: str
    task: dict[str, Any] | None
    retry_policy: dict[str, Any] | None
    timeout_sec: int | None
    job_exists: bool
    owner: str = ""  # whose run: decides command permission and the signing secret
    priority: Priority = Priority.NORMAL  # queue tier


_CLAIMED_COLUMNS = ClaimedRun._fields


def claimed_runs(rows: Sequence[asyncpg.Record]) -> list[ClaimedRun]:
    """The claim statements' rows as runs, by position rather than through a dict per row: their
    columns are ClaimedRun's fields, in order, which the first row of every batch checks."""
    if rows and tuple(rows[0].keys()) != _CLAIMED_COLUMNS:
        raise RuntimeError(f"a claim returned {tuple(rows[0].keys())}, not ClaimedRun's {_CLAIMED_COLUMNS}")
    make = ClaimedRun._make
    return [make(row) for row in rows]


class Outcome(Protocol):
    """What the store records of how an attempt ended (chimes.worker.tasks.common.Outcome is one):
    the store reads these three and decides nothing from them."""

    @property
    def status(self) -> RunStatus: ...
    @property
    def error(self) -> str | None: ...
    @property
    def output(self) -> str | None: ...


class Completion(NamedTuple):
    """An attempt that ended, to record: its run, its outcome (succeeded, failed or cancelled) and when.
    ``retry_at`` set: the run waits for another attempt then. A named tuple, one a run, as ClaimedRun."""

    run: ClaimedRun
    outcome: Outcome
    finished_at: datetime
    retry_at: datetime | None


async def runs_ended(conn: Conn, ended: Sequence[asyncpg.Record]) -> None:
    """Runs that ended stop counting against their job's concurrency, held runs move up, and the
    ones that failed for good queue their notification, all in the caller's transaction."""
    if ended:
        await conn.execute(sql("runs_ended"), [r["job_id"] for r in ended], [r["run_id"] for r in ended],
                           [r["scheduled_at"] for r in ended])


@contextlib.asynccontextmanager
async def by_key(pool: asyncpg.Pool) -> AsyncIterator[Conn]:
    """A transaction for a worker's batch statements, planned by key: begun with its settings in one
    round trip (begin_by_key) instead of two, as every round trip wakes the server and then the worker
    again."""
    async with pool.acquire() as conn:
        await conn.execute(sql("begin_by_key"))
        try:
            yield conn
        except BaseException:
            if not conn.is_closed():  # else the server has ended the transaction with the session
                with contextlib.suppress(*DB_ERRORS):
                    await conn.execute("ROLLBACK")
            raise
        await conn.execute("COMMIT")


_SET_LOCAL = re.compile(r"^SET LOCAL (\w+) = (\w+);?$", re.MULTILINE)


@functools.cache
def by_key_settings() -> dict[str, str]:
    """The settings begin_by_key gives a transaction, as settings of a whole session: read from the
    statement itself, so that the two cannot drift apart."""
    settings = dict(_SET_LOCAL.findall(sql("begin_by_key")))
    if not settings:
        raise RuntimeError("begin_by_key sets nothing: by_key_settings cannot read it")
    return settings


async def open_claims_pool(dsn: str) -> asyncpg.Pool:
    """A worker's connection for its claims, whose session is planned as :func:`by_key` plans a
    transaction. A claim is one statement, a transaction by itself: on it, one round trip instead of
    three (the settings with BEGIN, the claim, COMMIT). In a burst a worker's event loop answers each
    round trip only between the calls it handles, so each delays the claim while the runs it had
    are done and it waits. The connection
    is opened at the first claim, and its statements are bounded as the roles' pools bound theirs."""
    return await create_pool(dsn, min_size=0, max_size=1, server_settings=by_key_settings(),
                             command_timeout=command_timeout(ROLE_COMMAND_TIMEOUT_SEC))


class WorkerStore:
    def __init__(self, pool: asyncpg.Pool, worker_id: str, claims: asyncpg.Pool | None = None) -> None:
        """``claims``: a pool of :func:`open_claims_pool` for the claims; without one they begin
        their transaction on ``pool`` with :func:`by_key`."""
        self._pool = pool
        self.worker_id = worker_id
        self.claims = claims

    async def _claim_rows(self, query: str, *args: Any) -> list[asyncpg.Record]:
        if self.claims is not None:
            return await self.claims.fetch(query, *args)
        async with by_key(self._pool) as conn:
            return await conn.fetch(query, *args)

    async def register(self, hostname: str, pid: int, concurrency: int, in_flight: int) -> None:
        await self._pool.execute(sql("register_worker"), self.worker_id, hostname, pid, concurrency, in_flight,
                                 __version__)

    async def forget(self) -> None:
        await self._pool.execute(sql("forget_worker"), self.worker_id)

    async def claim(self, limit: int, lease_sec: float, deadline_grace_sec: float,
                    tiers: tuple[Priority, Priority] = (Priority.HIGH, Priority.BATCH),
                    skip_owners: Sequence[str] = ()) -> list[ClaimedRun]:
        """Claim up to ``limit`` runs of the tiers ``tiers[0]..tiers[1]``, both included, none of
        ``skip_owners`` (owners that hold their share of this worker)."""
        if limit <= 0:
            return []
        return claimed_runs(await self._claim_rows(sql("claim_runs"), limit, self.worker_id, lease_sec,
                                                   deadline_grace_sec, tiers[0], tiers[1], RUN_TIMEOUT_SEC,
                                                   list(skip_owners)))

    async def caps_exist(self) -> bool:
        exist: bool = await self._pool.fetchval(sql("caps_exist"))
        return exist

    async def claim_capped(self, limit: int, lease_sec: float, deadline_grace_sec: float, admit: Admission,
                           tiers: tuple[Priority, Priority] = (Priority.HIGH, Priority.BATCH)) -> list[ClaimedRun]:
        """Claim runs that fall under concurrency caps, never past a cap: one claimer at a time, and
        ``admit`` chooses among the candidates with the caps' usage counted under that lock."""
        if limit <= 0:
            return []
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(sql("lock_capped_claims"))
            rooms = rooms_of(await conn.fetch(sql("cap_usage")))
            rows = await conn.fetch(sql("capped_candidates"), limit * 4, tiers[0], tiers[1], *full_caps(rooms))
            chosen = admit((Candidate(r["queue_id"], r["owner"], r["tags"]) for r in rows), rooms, limit)
            if not chosen:
                return []
            claimed = await conn.fetch(sql("claim_queued_runs"), self.worker_id, lease_sec, deadline_grace_sec,
                                       chosen, RUN_TIMEOUT_SEC)
        return claimed_runs(claimed)

    async def claim_given_caps(self, limit: int, lease_sec: float, deadline_grace_sec: float, caps: Sequence[Cap],
                               tiers: tuple[Priority, Priority] = (Priority.HIGH, Priority.BATCH),
                               skip_owners: Sequence[str] = ()) -> list[ClaimedRun]:
        """:meth:`claim` on a shard, leaving the runs under the catalog's ``caps`` (a shard's own
        table of caps is empty) to :meth:`claim_capped_with_slots`."""
        if limit <= 0:
            return []
        return claimed_runs(await self._claim_rows(_caps_given("claim_runs", 9), limit, self.worker_id, lease_sec,
                                                   deadline_grace_sec, tiers[0], tiers[1], RUN_TIMEOUT_SEC,
                                                   list(skip_owners), *_cap_columns(caps)))

    async def claim_capped_with_slots(self, limit: int, lease_sec: float, deadline_grace_sec: float, admit: Admission,
                                      slots: CapSlots, shard_id: int | None,
                                      tiers: tuple[Priority, Priority] = (Priority.HIGH, Priority.BATCH),
                                      ) -> list[ClaimedRun]:
        """Claim capped runs with a shard map: each admitted run first takes a slot of every cap it
        falls under in the catalog (``slots``), counted under the catalog's lock. ``shard_id`` None:
        this store's database is the catalog, and the slots and the claim commit together;
        otherwise the slots commit first, then the claim on the shard, and the slots of runs the
        claim did not get are freed at once (a crash in between leaves them to lapse)."""
        if limit <= 0:
            return []
        if shard_id is None:
            async with self._pool.acquire() as conn, conn.transaction():
                rooms = await slots.count(conn)
                rows = await conn.fetch(sql("capped_candidates"), limit * 4, tiers[0], tiers[1], *full_caps(rooms))
                chosen, slots_of = _admitted(rows, rooms, limit, admit)
                if not chosen:
                    return []
                claimed = claimed_runs(await conn.fetch(
                    sql("claim_queued_runs"), self.worker_id, lease_sec, deadline_grace_sec, chosen, RUN_TIMEOUT_SEC))
                got = {run.run_id for run in claimed}
                await slots.take(conn, [slot for slot in slots_of if slot[1] in got], None, self.worker_id, lease_sec)
            return claimed
        caps = await slots.caps()
        if not caps:
            return []
        async with self._pool.acquire() as conn:
            async with conn.transaction():
                async with slots.catalog.acquire() as catalog, catalog.transaction():
                    rooms = await slots.count(catalog)
                    rows = await conn.fetch(_caps_given("capped_candidates"), limit * 4, tiers[0], tiers[1],
                                            *full_caps(rooms), *_cap_columns(caps))
                    chosen, slots_of = _admitted(rows, rooms, limit, admit)
                    if not chosen:
                        return []
                    await slots.take(catalog, slots_of, shard_id, self.worker_id, lease_sec)
                taken = list(dict.fromkeys(run_id for _, run_id in slots_of))
                try:
                    claimed = claimed_runs(await conn.fetch(
                        sql("claim_queued_runs"), self.worker_id, lease_sec, deadline_grace_sec, chosen,
                        RUN_TIMEOUT_SEC))
                except BaseException:
                    await _free_quietly(slots, taken, self.worker_id)
                    raise
            got = {run.run_id for run in claimed}
            await _free_quietly(slots, [run_id for run_id in taken if run_id not in got], self.worker_id)
        return claimed

    async def extend_leases(self, runs: Sequence[ClaimedRun], lease_sec: float) -> set[uuid.UUID]:
        """Extend the leases of ``runs``: their claims' rows, then the runs' own; returns the run ids
        still held (still running under their token)."""
        if not runs:
            return set()
        run_ids, scheduled = [r.run_id for r in runs], [r.scheduled_at for r in runs]
        tokens = [r.lease_token for r in runs]
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(sql("extend_claim_leases"), list(dict.fromkeys(tokens)), lease_sec)
            await conn.execute(sql("extend_leases"), run_ids, scheduled, tokens, lease_sec)
            rows = await conn.fetch(sql("runs_still_running"), run_ids, scheduled, tokens)
        return {row["run_id"] for row in rows}

    async def forget_claims(self, tokens: Sequence[uuid.UUID]) -> None:
        """Delete the lease rows of claims whose runs have all left this worker's hands."""
        if tokens:
            await self._pool.execute(sql("forget_claims"), list(tokens))

    async def give_up(self, runs: Sequence[ClaimedRun]) -> None:
        """Runs stopped here without an outcome: their leases expire now, each on its own, so the
        reaper ends their attempts as lost ones without waiting for the rest of their claims."""
        if runs:
            await self._pool.execute(sql("give_up_runs"), [r.run_id for r in runs], [r.scheduled_at for r in runs],
                                     [r.lease_token for r in runs])

    async def still_running(self, runs: Sequence[ClaimedRun]) -> set[uuid.UUID]:
        """The run ids of ``runs`` still running under the lease they were claimed with."""
        if not runs:
            return set()
        rows = await self._pool.fetch(sql("runs_still_running"), [r.run_id for r in runs],
                                      [r.scheduled_at for r in runs], [r.lease_token for r in runs])
        return {row["run_id"] for row in rows}

    async def complete(self, completions: Sequence[Completion],
                       forget: Sequence[uuid.UUID] = ()) -> set[uuid.UUID]:
        """Record a batch of outcomes in one statement, and delete the lease rows of the claims in
        ``forget`` (forget_claims) with it; returns the runs whose outcome was accepted."""
        if not completions:
            return set()
        async with by_key(self._pool) as conn:
            text, args = bind(
                "complete_runs", worker_id=self.worker_id, forget_claims=list(forget),
                outcome_run_id=[c.run.run_id for c in completions],
                outcome_scheduled_at=[c.run.scheduled_at for c in completions],
                outcome_lease_token=[c.run.lease_token for c in completions],
                outcome_status=[c.outcome.status for c in completions],
                outcome_error=[c.outcome.error for c in completions],
                outcome_output=[c.outcome.output for c in completions],
                outcome_finished_at=[c.finished_at for c in completions],
                outcome_retry_at=[c.retry_at for c in completions],
            )
            rows = await conn.fetch(text, *args)
            await runs_ended(conn, [r for r in rows if r["final"] and r["bookkeeping"]])
        return {row["run_id"] for row in rows}

    async def release(self, runs: Sequence[ClaimedRun]) -> set[uuid.UUID]:
        """Give runs back to the queue for another worker; returns the run ids handed back."""
        if not runs:
            return set()
        async with self._pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                sql("release_runs"), [r.run_id for r in runs], [r.scheduled_at for r in runs],
                [r.lease_token for r in runs],
            )
            await conn.execute(sql("notify_queue"), ANY_OWNER)
        return {row["run_id"] for row in rows}


@functools.cache  # the same text for every claim: made once per statement
def _caps_given(name: str, first: int = 8) -> str:
    """A claim statement reading the caps from parameters $first to $first+2 (scope, name, owner)
    instead of the table: the same statement, so the two cannot drift apart."""
    text = sql(name)
    params = f"unnest(${first}::text[], ${first + 1}::text[], ${first + 2}::text[])"
    given = text.replace("concurrency_caps cap", f"{params} AS cap(scope, name, owner)")
    if given.count(f"unnest(${first}") != 1:
        raise RuntimeError(f"{name} must read concurrency_caps exactly once")
    return given


def _cap_columns(caps: Sequence[Cap]) -> tuple[list[str], list[str], list[str]]:
    return [c.scope for c in caps], [c.name for c in caps], [c.owner for c in caps]


def _admitted(rows: Sequence[asyncpg.Record], rooms: Mapping[CapKey, int], limit: int,
              admit: Admission) -> tuple[list[int], list[tuple[CapKey, uuid.UUID]]]:
    """The queue ids ``admit`` chose, and a slot (cap, run) for every cap each of them falls under."""
    candidates = {r["queue_id"]: (Candidate(r["queue_id"], r["owner"], r["tags"]), r["run_id"]) for r in rows}
    chosen = admit((candidate for candidate, _ in candidates.values()), rooms, limit)
    slots = [(key, candidates[queue_id][1]) for queue_id in chosen for key in caps_of(candidates[queue_id][0], rooms)]
    return chosen, slots


async def _free_quietly(slots: CapSlots, run_ids: Sequence[uuid.UUID], holder: str) -> None:
    """Free slots the claim did not use; when the catalog does not answer, they lapse with their lease."""
    try:
        await slots.free(run_ids, holder)
    except DB_ERRORS as exc:
        log.warning("could not free %d cap slots now (%s); they lapse with their lease", len(run_ids), exc)


class RunSignals:
    """A connection of its own on which a worker LISTENs for runs enqueued (QUEUE_CHANNEL) and running
    runs cancelled (CANCEL_CHANNEL, the run id as payload)."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self._conn = conn

    @classmethod
    async def open(cls, dsn: str, *, check_timeout_sec: float, on_queued: Callable[[frozenset[str] | None], None],
                   on_cancel: Callable[[str], None], on_lost: Callable[[], None]) -> RunSignals:
        conn = await open_connection(dsn, command_timeout=check_timeout_sec)
        try:
            conn.add_termination_listener(lambda _: on_lost())
            await conn.add_listener(QUEUE_CHANNEL,
                                    lambda _conn, _pid, _channel, payload: on_queued(queued_owners(payload)))
            await conn.add_listener(CANCEL_CHANNEL, lambda _conn, _pid, _channel, payload: on_cancel(payload))
        except BaseException:
            conn.terminate()
            raise
        return cls(conn)

    async def check(self) -> None:
        """A round trip, bounded by the check timeout: LISTEN again (a no-op on a channel already
        listened to), so the session still shows what it is for in pg_stat_activity."""
        await self._conn.execute(sql("listen_queue"))

    def drop(self) -> None:
        """Never a wait: the server may be the one that stopped answering."""
        if not self._conn.is_closed():
            self._conn.terminate()
