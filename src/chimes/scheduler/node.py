"""A scheduler node: the loops that lease partitions, scan them, fire on the second, and reap."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from chimes import failures, metrics, tracing
from chimes.clock import SYSTEM_CLOCK, Clock
from chimes.notifier import Notifier, NotifierConfig
from chimes.scheduler.calendar_book import CALENDAR_REFRESH_SEC, CalendarBook
from chimes.scheduler.database_clock import DatabaseClock
from chimes.scheduler.firing import fires_ahead, follow_up, plan_fire, walks
from chimes.scheduler.health import HealthCheck
from chimes.scheduler.leases import LeaseConfig, LeaseManager
from chimes.scheduler.reaper import Reaper
from chimes.scheduler.retention import Retention
from chimes.scheduler.timer_wheel import TimerWheel
from chimes.security.ssrf import EgressPolicy
from chimes.services.owners import SigningSecrets
from chimes.settings import FIRE_AHEAD_SEC, MISSED_AFTER_SEC, NOTIFY_GIVE_UP_HOURS, RETENTION_DAYS
from chimes.store.db import DB_ERRORS, Pool, describe
from chimes.store.migrate import ensure_run_partitions
from chimes.store.scheduling import DueTrigger, Fire, FireResult, PartitionSignals, SchedulerStore
from chimes.timeouts import wait_event

log = logging.getLogger(__name__)
BEHIND_SEC = 1.0  # a node whose oldest held trigger is this late is firing a backlog


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    lease: LeaseConfig = field(default_factory=LeaseConfig)
    lookahead_sec: float = 5.0  # how far ahead the scan fetches triggers into the wheel
    scan_every_sec: float = 1.0
    scan_limit: int = 200_000
    fire_batch_size: int = 1000
    fire_concurrency: int = 3  # batches fired at once, each on its own connection
    fire_coalesce_sec: float = 0.02  # a trigger waits this long for others due just after it
    # An instant with at least fire_ahead_min triggers is fired up to fire_ahead_sec before it, in
    # batches of up to fire_ahead_batch_size, fire_ahead_concurrency at once, each committed at the
    # instant (SchedulerStore.fire_ahead): a burst's runs are there at its second, not written after
    # it. Only the triggers firing.fires_ahead allows; the others of the instant fire at it. 0: off.
    fire_ahead_sec: float = FIRE_AHEAD_SEC
    fire_ahead_min: int = 500
    fire_ahead_batch_size: int = 5000
    fire_ahead_concurrency: int = 4
    reap_every_sec: float = 2.0
    missed_after_sec: float = MISSED_AFTER_SEC  # later than this, catch-up policies apply
    retention_days: int = RETENTION_DAYS  # run history older than this is dropped, a day's partition at a time
    notify_every_sec: float = 1.0
    notify_give_up_sec: float = NOTIFY_GIVE_UP_HOURS * 3600  # a notification undelivered this long is dead-lettered
    health_every_sec: float = 10.0
    maintain_every_sec: float = 3600.0
    # Send each fire when the database's clock reaches it, by the offset measured every
    # clock_every_sec; off, a fast host's fires are refused and fire after the next scan.
    follow_database_clock: bool = True
    clock_every_sec: float = 1.0
    # The health check, the reaper and maintenance read what grows with all jobs and runs; while the
    # node is firing a burst they wait for it to be fired, at most this long, so they do not compete
    # with it for the database and the node's event loop.
    after_burst_max_wait_sec: float = 10.0
    # A node asked to stop fires what is due until no held trigger is due within handover_lead_sec,
    # then hands its partitions over (at most handover_max_sec after the request): the nodes that take
    # them, told at once, have that long to read them before their next slot.
    handover_lead_sec: float = 0.5
    handover_max_sec: float = 2.0
    listen_check_every_sec: float = 5.0  # a query on the LISTEN connection: a host that vanished is noticed


@dataclass(slots=True)
class SchedulerStats:
    fired: int = 0
    enqueued: int = 0
    refused: int = 0  # triggers in batches whose lease was no longer held
    too_early: int = 0  # triggers the database found not yet due (a host clock ahead of it)
    fired_ahead: int = 0  # triggers fired by batches fired ahead of their time and committed at it
    ahead_rolled_back: int = 0  # triggers of such batches rolled back at their time, and fired then
    max_fire_lag_sec: float = 0.0


def new_node_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class SchedulerNode:
    def __init__(self, pool: Pool, config: SchedulerConfig | None = None,
                 node_id: str | None = None, clock: Clock = SYSTEM_CLOCK, *,
                 signing_secrets: SigningSecrets | None = None, egress: EgressPolicy | None = None,
                 serves: frozenset[int] | None = None, calendars: CalendarBook | None = None,
                 listen_dsn: str | None = None, store: SchedulerStore | None = None) -> None:
        """``serves``: with shards, the partitions ``pool``'s database holds (for the partitions gauge).
        ``calendars``: read from the catalog (``pool`` without shards). ``listen_dsn``: ``pool``'s
        database, for a connection of its own on which the node hears of partitions handed over by a
        node that stops; without it the node finds them at its next lease round. ``store``: where the
        node reads and fires triggers (its node id is this node's); without it, ``pool``'s database."""
        self.config = config or SchedulerConfig()
        self.store = store or SchedulerStore(pool, node_id or new_node_id())
        self.wheel = TimerWheel()
        self.leases = LeaseManager(self.store, self.config.lease, on_lost=self._on_partitions_lost, serves=serves)
        self.reaper = Reaper(self.store)
        # Webhooks go out under the operator's egress policy, signed like task calls (docs/security.md).
        self.notifier = Notifier(pool, signing_secrets or SigningSecrets(pool), NotifierConfig(
            egress=egress, give_up_after_sec=self.config.notify_give_up_sec))
        self.health = HealthCheck(pool)
        self.calendars = calendars or CalendarBook(pool)
        self.retention = Retention(pool, self.config.retention_days)
        self.stats = SchedulerStats()
        self._pool = pool
        self.clock = DatabaseClock(clock, follow=self.config.follow_database_clock)
        self._listen_dsn = listen_dsn
        self._leases_changed = asyncio.Event()  # a node handed its partitions over: a lease round now
        self._wake = asyncio.Event()
        self._quiet = asyncio.Event()  # set when the fire loop has nothing due and no batch in flight
        self._stopping = asyncio.Event()
        self._fire_slots = asyncio.Semaphore(self.config.fire_concurrency)
        self._batches: set[asyncio.Task[None]] = set()
        self._ahead_in_flight = 0  # batches fired ahead, waiting for their instant or committing
        self._ahead_declined = float("-inf")  # the last instant found too small to fire ahead
        self._scanned_until: datetime | None = None  # the look-ahead the last scan read in full
        # The wheel holds a fire's next trigger only if it is due before this, the end of the look-ahead
        # the wheel was given, so that the wheel's sums and the database's cover the same triggers.
        self._held_until: datetime | None = None
        # A scan and the read of partitions just gained take turns: a scan that began before a gain
        # would otherwise move the look-ahead past what the read of the gained partitions covered.
        self._reading = asyncio.Lock()
        self._reads: set[asyncio.Task[None]] = set()  # reads of partitions just gained
        self._keys_read_at = float("-inf")  # when the held part of the look-ahead was last re-read (loop time)
        self._keys_read_of: frozenset[int] = frozenset()  # and for which partitions
        self._ended_while_counting: set[int] | None = None  # partitions of batches that end meanwhile

    @property
    def node_id(self) -> str:
        return self.store.node_id

    def _now(self) -> datetime:
        return self.clock.now()

    def _on_partitions_lost(self, partitions: set[int]) -> None:
        dropped = self.wheel.drop_partitions(partitions)
        if dropped:
            log.info("dropped %d held triggers of %d lost partitions", dropped, len(partitions))

    async def run(self) -> None:
        """Run until :meth:`stop`; then fire what is due and hand the partitions over, so that the
        other nodes fire the next slots on time."""
        log.info("scheduler node %s starting", self.node_id)
        taking = [  # what takes in more work: stopped first when the node is asked to stop
            self._every(self.config.lease.renew_every_sec, self._sync_leases, wake=self._leases_changed),
            self._every(self.config.scan_every_sec, self._scan),
        ]
        loops = [
            self._every(self.config.clock_every_sec, self._measure_clock),
            self._every(CALENDAR_REFRESH_SEC, self._refresh_calendars),
            self._every(self.config.reap_every_sec, self.after_burst(self._reap)),
            self._every(self.config.maintain_every_sec, self.after_burst(self._maintain)),
            self._every(self.config.notify_every_sec, self._notify),
            self._every(self.config.health_every_sec, self.after_burst(self._check_health)),
            self._fire_loop(),
        ]
        if self._listen_dsn is not None:
            loops.append(self._listen_loop(self._listen_dsn))
        taking_tasks = [asyncio.create_task(loop) for loop in taking]
        tasks = [asyncio.create_task(loop) for loop in loops]
        try:
            await self._stopping.wait()
            await _cancelled(taking_tasks + list(self._reads))
            await self._fire_what_is_due()
        finally:
            await _cancelled(taking_tasks + tasks)
            # Batches already sent finish (they are short transactions) before the leases go back.
            await asyncio.gather(*self._batches, return_exceptions=True)
            await self.notifier.close()
            try:
                await self.leases.release_all()
            except DB_ERRORS as exc:
                log.warning("could not release partitions on shutdown (they expire on their own): %s",
                            describe(exc))
            log.info("scheduler node %s stopped", self.node_id)

    async def _fire_what_is_due(self) -> None:
        """Before the partitions go: fire until no held trigger is due within ``handover_lead_sec``
        (the slot under way, and the next one when it is that close), at most ``handover_max_sec``."""
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + self.config.handover_max_sec
        while loop.time() < give_up_at:
            if self._batches:
                await asyncio.wait(set(self._batches), timeout=give_up_at - loop.time())
                continue
            first = self.wheel.next_due()
            now = self.clock.time()
            if first is None or first > now + self.config.handover_lead_sec:
                return
            self._wake.set()  # the fire loop fires it at its time; look again just after
            await asyncio.sleep(min(max(0.0, first - now) + self.config.fire_coalesce_sec,
                                    give_up_at - loop.time()))
        log.warning("handing partitions over with triggers still due: stopping took longer than %ss",
                    self.config.handover_max_sec)

    async def _listen_loop(self, dsn: str) -> None:
        """Hear of partitions handed over by nodes that stop (PARTITIONS_CHANNEL): a lease round then,
        rather than at the next one. A connection of its own; opened again when the database drops it."""
        while True:
            try:
                async with PartitionSignals(dsn, self.node_id, self._leases_changed.set) as signals:
                    while await signals.alive(self.config.listen_check_every_sec):
                        pass
                log.warning("the LISTEN connection was lost; taking partitions over at lease rounds until it is back")
            except Exception as exc:
                failures.loop_failed("scheduler", "listen", exc)
                await asyncio.sleep(self.config.lease.renew_every_sec)

    def stop(self) -> None:
        self._stopping.set()

    async def _every(self, interval: float, step: Callable[[], Awaitable[None]],
                     wake: asyncio.Event | None = None) -> None:
        """Run ``step`` every ``interval`` seconds, and at once when ``wake`` is set. A step that fails,
        for whatever reason, is logged with its cause, counted, and tried again next time: no error ends
        a loop of the node."""
        while True:
            started = time.monotonic()
            if wake is not None:
                wake.clear()
            try:
                await step()
            except Exception as exc:
                failures.loop_failed("scheduler", step.__name__.lstrip("_"), exc)
            left = max(0.0, interval - (time.monotonic() - started))
            if wake is None:
                await asyncio.sleep(left)
            else:
                await wait_event(wake, left)

    async def _sync_leases(self) -> None:
        try:
            async with asyncio.timeout(self.config.lease.ttl_sec / 2):  # not wait_for: chimes.timeouts
                gained = await self.leases.sync()
        except asyncio.CancelledError:
            raise  # the node is stopping: it fires what is due with what it holds, then hands it all over
        except BaseException:
            # Unsure whether we still hold anything: stop firing locally until a round succeeds.
            # (The database would refuse stale fires anyway; this just avoids the wasted work.)
            self.leases.drop_all()
            raise
        if gained and self.leases.short:
            # Partitions given up by another node but still locked by its last batch were skipped:
            # another round shortly, once that batch has most likely ended, rather than at the next.
            asyncio.get_running_loop().call_later(self.config.lease.short_retry_sec, self._leases_changed.set)
        if gained:  # in a task of its own: it may wait for a scan, and the lease loop must not
            task = asyncio.create_task(self._scan_gained(gained))
            self._reads.add(task)
            task.add_done_callback(self._reads.discard)

    async def _scan_gained(self, gained: set[int]) -> None:
        """Read the partitions just taken over at once, up to the look-ahead the wheel holds, rather
        than at the next scan: a node that stopped, or that gave them to this one, handed them over
        just before their next slot. A node that has read nothing yet scans all it holds."""
        try:
            async with self._reading:
                until = self._held_until
                if until is None:
                    await self._scan_held()
                    return
                triggers = await self.store.scan_due(sorted(gained), until, self.config.scan_limit)
                held = self.leases.held
                if sum(self._hold(t) for t in triggers if t.partition_id in held):
                    self._wake.set()
        except Exception as exc:  # counted as the scan's: the next scan reads them
            failures.loop_failed("scheduler", "scan", exc)

    async def _refresh_calendars(self) -> None:
        await self.calendars.refresh()

    async def _measure_clock(self) -> None:
        self.clock.record(await self.store.clock_sample(self.clock.host.time))
        metrics.record_clock_offset(self.clock.offset_sec)

    async def _scan(self) -> None:
        async with self._reading:
            await self._scan_held()

    async def _scan_held(self) -> None:
        held = self.leases.held
        if not held:
            return
        until = self._now() + timedelta(seconds=self.config.lookahead_sec)
        triggers = await self._due_before(list(held), until)
        current = self.leases.held  # partitions may have been lost while the scan ran
        added = 0
        for trigger in triggers:
            if trigger.partition_id not in current:
                continue
            added += self._hold(trigger)
        self._held_until = until
        if added:
            self._ahead_declined = float("-inf")  # an instant found too small may have grown
            self._wake.set()

    def _set_aside(self, trigger: DueTrigger, exc: Exception) -> None:
        """One trigger that cannot be fired must not hold up the others: it stays in the database,
        and this node leaves it alone until its job changes."""
        self.wheel.set_aside(trigger)
        failures.set_aside("scheduler", "trigger", f"trigger of job {trigger.job_id} due {trigger.fire_at}", exc)

    async def _due_before(self, partitions: list[int], until: datetime) -> list[DueTrigger]:
        """Every trigger of these partitions due before ``until``. The part of the look-ahead the last
        scan read is mostly held already: only partitions where the database's count and sum of fire
        times there differ from the wheel's are re-read, by key, and only triggers written there since
        (or not held: a failed batch, a partition just gained) are read in full. Re-reading every held
        key each second cost a third of the node's CPU per fire at the top of the hour, most of it
        receiving the keys (docs/benchmarks.md).

        While the node is behind (its oldest held trigger more than ``BEHIND_SEC`` late: a burst being
        fired) that check waits: what it would find waits behind the backlog anyway. It runs once the
        backlog is fired, at the latest after ``after_burst_max_wait_sec``, and at once when the
        node's partitions change."""
        read_before, self._scanned_until = self._scanned_until, None
        limit = self.config.scan_limit
        if read_before is None or read_before >= until:
            triggers = await self.store.scan_due(partitions, until, limit)
            self._keys_read(partitions)
        else:
            triggers = await self.store.scan_due(partitions, until, limit, after=read_before)
            if not self._skip_key_reread(partitions):
                written, whole = await self._written_since_read(partitions, read_before)
                triggers += written
                if whole:
                    self._keys_read(partitions)
        self._scanned_until = until
        return triggers

    async def _written_since_read(self, partitions: list[int], before: datetime) -> tuple[list[DueTrigger], bool]:
        """The triggers due before ``before`` that the wheel does not hold, and whether every partition
        was checked. A partition that gained and lost a trigger with the same fire time keeps its sums:
        what it gained is found once what it lost is fired.

        A batch that ends while the database counts may be counted on one side and not on the other
        (fired in the database's count, still in flight in the wheel's): the partitions of such
        batches are left for the next check, unless the last whole check is older than
        ``after_burst_max_wait_sec``. Reading their keys instead read 644 partitions' keys mid-burst."""
        held = self.wheel.sums()
        self._ended_while_counting = set()
        try:
            found = await self.store.due_trigger_sums(partitions, before)
        finally:
            ended, self._ended_while_counting = self._ended_while_counting, None
        wanted = set(partitions)
        changed = [p for p in found.keys() | held.keys() if p in wanted and found.get(p) != held.get(p)]
        unsure = ended.intersection(changed)
        overdue = asyncio.get_running_loop().time() - self._keys_read_at >= self.config.after_burst_max_wait_sec
        if unsure and not overdue:
            changed = [p for p in changed if p not in unsure]
        whole = overdue or not unsure
        if not changed:
            return [], whole
        keys = await self.store.scan_due_keys(changed, before, self.config.scan_limit)
        unknown = [key for key in keys if key not in self.wheel]
        return (await self.store.due_triggers(unknown) if unknown else []), whole

    def _keys_read(self, partitions: list[int]) -> None:
        self._keys_read_at = asyncio.get_running_loop().time()
        self._keys_read_of = frozenset(partitions)

    def _skip_key_reread(self, partitions: list[int]) -> bool:
        first = self.wheel.next_due()
        behind = first is not None and first <= self.clock.time() - BEHIND_SEC
        recent = asyncio.get_running_loop().time() - self._keys_read_at < self.config.after_burst_max_wait_sec
        return behind and recent and self._keys_read_of == frozenset(partitions)

    def firing(self) -> bool:
        """Whether the node is firing: batches in flight, or held triggers whose time has come."""
        if self._batches:
            return True
        first = self.wheel.next_due()
        return first is not None and first <= self.clock.time()

    def after_burst(self, step: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        """``step``, run once the node is no longer firing, or after ``after_burst_max_wait_sec``
        however busy it is (a steady stream of fires must not starve the health check)."""
        async def deferred() -> None:
            loop = asyncio.get_running_loop()
            give_up_at = loop.time() + self.config.after_burst_max_wait_sec
            while self.firing() and loop.time() < give_up_at:
                self._quiet.clear()  # set again by the fire loop once it has nothing due left
                await wait_event(self._quiet, give_up_at - loop.time())
            await step()

        deferred.__name__ = step.__name__  # the loop's name in logs and metrics
        return deferred

    async def _check_health(self) -> None:
        await self.health.sweep(self._now())

    async def _notify(self) -> None:
        await self.notifier.deliver_due()

    async def _reap(self) -> None:
        await self.reaper.sweep(self.leases.held, self._now())

    async def _maintain(self) -> None:
        await ensure_run_partitions(self._pool)
        await self.retention.sweep(self._now())
        await self.store.forget_dead_nodes()

    async def _fire_loop(self) -> None:
        while True:
            try:
                await self._fire_due()
            except Exception as exc:
                failures.loop_failed("scheduler", "fire_loop", exc)
                await asyncio.sleep(self.config.scan_every_sec)

    async def _fire_due(self) -> None:
        # Triggers due within fire_coalesce_sec of the first go in its batch: under a steady stream
        # a batch of one costs the database nearly as much as a batch of a hundred.
        coalesce = self.config.fire_coalesce_sec
        while True:
            now = self.clock.time()
            first = self.wheel.next_due()
            due = self.wheel.pop_due(now, limit=self.config.fire_batch_size) if (
                first is not None and first <= now - coalesce) else []
            if due:
                await self._fire_slots.acquire()
                task = asyncio.create_task(self._fire_batch(due))
                self._batches.add(task)
                task.add_done_callback(self._batch_done)
                continue
            if first is not None and self._ahead_ready(first, now):
                self._fire_ahead_batch(self.wheel.pop_due(first + coalesce, limit=self.config.fire_ahead_batch_size))
                continue
            self._wake.clear()
            if not self.firing():
                self._quiet.set()
            next_due = self.wheel.next_due()
            delay = 0.25 if next_due is None else min(0.25, max(0.0, next_due + coalesce - now))
            if next_due is not None and self._ahead_room() and next_due > self._ahead_declined:
                delay = min(delay, max(0.0, next_due - self.config.fire_ahead_sec - now))
            await wait_event(self._wake, delay)

    def _batch_done(self, task: asyncio.Task[None]) -> None:
        self._batches.discard(task)
        self._fire_slots.release()
        if not self.firing():
            self._quiet.set()

    def _ahead_room(self) -> bool:
        return self.config.fire_ahead_sec > 0 and self._ahead_in_flight < self.config.fire_ahead_concurrency

    def _ahead_ready(self, first: float, now: float) -> bool:
        """Whether the earliest instant held is within fire_ahead_sec and large enough to fire ahead."""
        if not self._ahead_room() or first > now + self.config.fire_ahead_sec or first <= self._ahead_declined:
            return False
        enough = self.config.fire_ahead_min
        if self.wheel.count_due(first + self.config.fire_coalesce_sec, enough) < enough:
            self._ahead_declined = first  # fired at its time, as a steady stream's instants are
            return False
        return True

    def _fire_ahead_batch(self, due: list[DueTrigger]) -> None:
        early = [t for t in due if fires_ahead(t)]
        on_time = [t for t in due if not fires_ahead(t)]
        if on_time:
            self._track(asyncio.create_task(self._fire_at_its_time(on_time)))
        if early:
            self._ahead_in_flight += 1
            task = asyncio.create_task(self._fire_ahead(early))
            self._track(task)
            task.add_done_callback(self._ahead_done)

    def _track(self, task: asyncio.Task[None]) -> None:
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)

    def _ahead_done(self, task: asyncio.Task[None]) -> None:
        self._ahead_in_flight -= 1
        self._wake.set()
        if not self.firing():
            self._quiet.set()

    async def _until(self, at: datetime) -> None:
        """Wait until the node's clock, which follows the database's, reaches ``at``."""
        wait = at.timestamp() - self.clock.time()
        if wait > 0:
            await asyncio.sleep(wait)

    async def _fire_at_its_time(self, due: list[DueTrigger]) -> None:
        await self._until(max(t.fire_at for t in due))
        async with self._fire_slots:
            await self._fire_batch(due)

    async def _fire_ahead(self, due: list[DueTrigger]) -> None:
        """Fire a batch ahead of its instant and commit it at the instant; rolled back (a job changed, a
        lease lost) or failed, it is fired the ordinary way once due."""
        due_at = max(t.fire_at for t in due)
        fires: list[Fire] = []
        result = None
        try:
            fires = self._plan(due, due_at)
            if fires:
                ahead = self.config.fire_ahead_sec + self.config.fire_coalesce_sec
                result = await self.store.fire_ahead(self.leases.held, fires, due_at, ahead,
                                                     lambda: self._until(due_at))
        except Exception as exc:
            failures.loop_failed("scheduler", "fire_ahead", exc)
        if fires and result is None:
            self.stats.ahead_rolled_back += len(due)
            await self._fire_at_its_time(due)
            return
        self._batch_ended(due)
        if result is not None:
            self.stats.fired_ahead += result.fired
            self._fired([f.trigger for f in fires], fires, due_at, result)

    async def _fire_batch(self, due: list[DueTrigger]) -> None:
        fired_at = self._now()

        async def fire(some: Sequence[Fire]) -> tuple[FireResult, int]:
            result = await self.store.fire(self.leases.held, some, fired_at)
            return result, len({f.trigger.partition_id for f in some}) - result.leases_held

        try:
            fires = await self._plan_off_loop(due, fired_at)
            # One transaction per call: a batch that fails committed nothing, so its halves can be
            # fired apart until the trigger that fails it alone is found and set aside.
            done = await failures.narrow_down(fires, fire, lambda bad, exc: self._set_aside(bad.trigger, exc))
        except Exception as exc:
            # Nothing was committed; the triggers are still in the database and the next scan
            # brings them back.
            failures.loop_failed("scheduler", "fire_batch", exc)
            return
        finally:
            self._batch_ended(due)
        if done:
            lost = sum(partitions_lost for _, partitions_lost in done)
            fired = [f.trigger for f in fires]
            result = FireResult(len({t.partition_id for t in fired}) - lost, sum(r.fired for r, _ in done),
                                sum(r.enqueued for r, _ in done), sum(r.too_early for r, _ in done))
            self._fired(fired, fires, fired_at, result)
            if not lost and result.fired + result.too_early < len(fires):
                await self._read_again(fired)

    async def _read_again(self, sent: list[DueTrigger]) -> None:
        """Triggers of a batch that neither fired nor were too early were changed since they were read:
        an edit that kept a due slot gave its trigger the job's new version. Read them again at once
        and hold those still there, rather than at the next scan, after the slot that follows."""
        versions = {t.key: t.job_version for t in sent}
        try:
            current = await self.store.due_triggers(list(versions))
        except DB_ERRORS as exc:
            log.warning("could not read changed triggers again (the next scan will): %s", describe(exc))
            return
        held = self.leases.held
        changed = [t for t in current if t.partition_id in held and t.job_version != versions[t.key]]
        if sum(self._hold(t) for t in changed):
            self._wake.set()

    def _batch_ended(self, due: list[DueTrigger]) -> None:
        self.wheel.done(due)
        if self._ended_while_counting is not None:
            self._ended_while_counting.update(t.partition_id for t in due)

    async def _plan_off_loop(self, due: list[DueTrigger], fired_at: datetime) -> list[Fire]:
        """Plan a batch; where a trigger was missed (its slots walked up to now, possibly many), in a
        thread of its own, so that the node's loop keeps renewing its leases meanwhile."""
        missed_after = timedelta(seconds=self.config.missed_after_sec)
        if not any(walks(t, fired_at, missed_after) for t in due):
            return self._plan(due, fired_at)
        return await asyncio.to_thread(self._plan, due, fired_at)

    def _plan(self, due: list[DueTrigger], fired_at: datetime) -> list[Fire]:
        missed_after = timedelta(seconds=self.config.missed_after_sec)
        fires = []
        for trigger in due:
            if trigger.exclude_calendars and not self.calendars.knows(trigger.owner or "", trigger.exclude_calendars):
                continue  # left in the database: a later scan brings it back once the calendars are read
            try:
                fires.append(plan_fire(trigger, fired_at, missed_after, self.calendars.calendars))
            except Exception as exc:  # a schedule or a time its slots cannot be computed for
                self._set_aside(trigger, exc)
        return fires

    def _fired(self, due: list[DueTrigger], fires: list[Fire], fired_at: datetime, result: FireResult) -> None:
        self.stats.fired += result.fired
        self.stats.enqueued += result.enqueued
        self.stats.too_early += result.too_early
        metrics.record_fires(due, fired_at, result)
        tracing.fired(fires, refused=result.leases_held < len({t.partition_id for t in due}))
        lag = (fired_at - min(t.fire_at for t in due)).total_seconds()
        self.stats.max_fire_lag_sec = max(self.stats.max_fire_lag_sec, lag)
        if result.leases_held < len({t.partition_id for t in due}):
            self.stats.refused += len(due) - result.fired
            log.warning("fencing refused a batch of %d triggers: lease lost for some partitions", len(due))
        horizon = self._held_until
        held = self.leases.held
        for fire in fires:  # most next fires are far off: checked before follow_up builds the trigger
            if (horizon is None or fire.next_fire_at is None or fire.next_fire_at >= horizon
                    or fire.trigger.partition_id not in held):
                continue
            nxt = follow_up(fire)
            if nxt is not None:
                self._hold(nxt)
        self._wake.set()

    def _hold(self, trigger: DueTrigger) -> bool:
        try:
            return self.wheel.add(trigger)
        except Exception as exc:  # a time that is no time (stored before such times were refused)
            self._set_aside(trigger, exc)
            return False


async def _cancelled(tasks: Sequence[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
