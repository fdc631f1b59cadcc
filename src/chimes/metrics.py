"""Prometheus metrics: every metric Chimes exports is defined here, once.

Each process exports what it does itself: a scheduler node its fires, leases and reaps, a worker
its runs and tasks, the API its request latency plus the fleet-wide gauges it reads from the
database at scrape time (queue depth, live nodes and workers). ``chimes up`` is one process, so its
``/metrics`` has all of them. Labels never carry job or run ids, and every label takes its value from a
fixed set (anything else counts as ``other``): a client must not be able to add series, since each
costs memory in this process and in Prometheus for as long as they run.
"""

from __future__ import annotations

import asyncio
import bisect
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram, generate_latest
from prometheus_client import start_http_server as _start_http_server

from chimes.enums import RunStatus
from chimes.store.dashboard import add_up, fleet_gauges
from chimes.store.db import Pool
from chimes.store.moves import MOVER_GONE_AFTER_SEC, PHASES_UNDER_WAY, Move, move_under_way

if TYPE_CHECKING:
    from chimes.store.scheduling import DueTrigger, FireResult
    from chimes.store.working import ClaimedRun, Completion

# Lateness is what a scheduler promises to keep small: fine buckets below a few seconds.
LAG_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
API_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# --- every role ----------------------------------------------------------------------------------
LOOP_FAILURES = Counter("chimes_loop_failures_total",
                        "Steps of a long-lived loop that failed and were tried again (chimes.failures).",
                        ["role", "loop"])
ITEMS_SET_ASIDE = Counter("chimes_items_set_aside_total",
                          "Items (triggers, outcomes, expired runs) set aside because handling them failed.",
                          ["role", "kind"])

# The values each label may take; anything else is counted as OTHER.
OTHER = "other"
UNMATCHED = "unmatched"  # the route of a request no route of the app matched (never its raw path)
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
TASK_TYPES = frozenset({"http", "command", "container", "none"})
OUTCOME_STATUSES = frozenset(str(s) for s in (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED))


def bounded(value: str, allowed: frozenset[str]) -> str:
    """``value`` when it is one of ``allowed``, else ``other``: what keeps a label's series few."""
    return value if value in allowed else OTHER


def status_label(status: int) -> str:
    """An HTTP status as a label: one of the 500 codes HTTP has, whatever the app sends."""
    return str(status) if 100 <= status <= 599 else OTHER


# --- scheduler node ----------------------------------------------------------------------------
FIRE_LAG = Histogram("chimes_fire_lag_seconds", "Seconds between a trigger's due time and its firing.",
                     buckets=LAG_BUCKETS)
TRIGGERS_FIRED = Counter("chimes_triggers_fired_total", "Triggers fired (runs created or retries re-enqueued).")
FIRES_REFUSED = Counter("chimes_fires_refused_total",
                        "Triggers in batches the fencing token refused (the partition lease was lost).")
FIRES_TOO_EARLY = Counter("chimes_fires_too_early_total",
                          "Triggers sent before their time by the database's clock; they fire after the next scan.")
CLOCK_OFFSET = Gauge("chimes_scheduler_clock_offset_seconds",
                     "How far the database's clock is ahead of this node's host clock (negative: behind).")
PARTITIONS_OWNED = Gauge("chimes_partitions_owned", "Trigger partitions this scheduler node holds.")
LEASE_CHANGES = Counter("chimes_lease_changes_total", "Partitions this node gained or lost.", ["change"])
REAPER_REQUEUED = Counter("chimes_reaper_requeued_total",
                          "Lost or overdue runs the reaper handed back for another attempt.")

# --- worker --------------------------------------------------------------------------------------
START_LAG = Histogram("chimes_start_lag_seconds",
                      "Seconds between a run's scheduled time and the start of its first attempt.",
                      buckets=LAG_BUCKETS)
RUNS_FINISHED = Counter("chimes_runs_finished_total", "Runs that reached a final status.", ["status"])
RETRIES = Counter("chimes_run_retries_total", "Failed attempts that will be retried.", ["by"])
TASK_DURATION = Histogram("chimes_task_duration_seconds", "Seconds one attempt of a task ran.", ["type", "status"],
                          buckets=DURATION_BUCKETS)

# --- API -----------------------------------------------------------------------------------------
API_LATENCY = Histogram("chimes_api_request_duration_seconds", "Seconds the API took to answer a request.",
                        ["method", "route", "status"], buckets=API_BUCKETS)
QUEUE_DEPTH = Gauge("chimes_queue_depth", "Runs waiting in the queue for a worker (counted up to a cap).", ["tier"])
QUEUE_OLDEST = Gauge("chimes_queue_oldest_seconds", "Age of the oldest run waiting in the queue.", ["tier"])
LIVE_NODES = Gauge("chimes_scheduler_nodes_live", "Scheduler nodes that heartbeated recently.")
LIVE_WORKERS = Gauge("chimes_workers_live", "Workers that heartbeated recently.")
PARTITIONS_UNLEASED = Gauge("chimes_partitions_unleased", "Trigger partitions no live node holds.")
# A partition move under way (one at a time, in the catalog): labels from PHASES_UNDER_WAY only.
MOVE_PHASE = Gauge("chimes_shard_move_phase",
                   "1 for the phase of the partition move under way (copying, fenced, cut_over), 0 for the others.",
                   ["phase"])
MOVE_FENCED = Gauge("chimes_shard_move_fenced_seconds",
                    "Seconds the range of the move under way has fired nowhere (since its fence); 0 when none is.")
MOVE_HEARTBEAT_AGE = Gauge("chimes_shard_move_heartbeat_age_seconds",
                           "Age of the heartbeat of the mover of the move under way (gone after "
                           f"{MOVER_GONE_AFTER_SEC:g} s); 0 when no move is under way.")


def observe_many(histogram: Histogram, amounts: Sequence[float]) -> None:
    """``histogram.observe(amount)`` for each amount, with one update of the sum and of each bucket
    the amounts fall in. A worker observes a start lag and a task duration for every run and a node a
    fire lag for every fire, and each ``observe`` takes two locks and walks the buckets; a batch of
    runs falls into a few buckets. Where the client library does not keep a histogram's buckets as
    this expects (or for a histogram with labels and no child, which ``observe`` refuses), each
    amount is observed on its own."""
    bounds: list[float] | None = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(buckets) != len(bounds):
        for amount in amounts:
            histogram.observe(amount)
        return
    counts: dict[int, int] = {}
    for amount in amounts:
        if amount == amount:  # observe counts a NaN in the sum only: it is in no bucket
            i = bisect.bisect_left(bounds, amount)  # the first bucket with amount <= its bound, as observe
            counts[i] = counts.get(i, 0) + 1
    if amounts:
        total.inc(sum(amounts))
    for i, count in counts.items():
        buckets[i].inc(count)


def record_fires(due: Sequence[DueTrigger], fired_at: datetime, result: FireResult) -> None:
    """One fired batch: the lag of each trigger in it, and how many fired or were fenced out."""
    observe_many(FIRE_LAG, [max(0.0, (fired_at - trigger.fire_at).total_seconds()) for trigger in due])
    TRIGGERS_FIRED.inc(result.fired)
    if result.leases_held < len({t.partition_id for t in due}):
        FIRES_REFUSED.inc(len(due) - result.fired)
    if result.too_early:
        FIRES_TOO_EARLY.inc(result.too_early)


def record_clock_offset(offset_sec: float) -> None:
    CLOCK_OFFSET.set(offset_sec)


_owned_by_node: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()  # one node per home


def record_partitions_owned(node: object, owned: int) -> None:
    """``owned``: of the partitions ``node``'s home holds, how many it leases. The gauge adds up the
    process's nodes: with shards it counts each partition on its own home, out of 1,024."""
    _owned_by_node[node] = owned
    PARTITIONS_OWNED.set(sum(_owned_by_node.values()))


def record_lease_round(node: object, owned: int, gained: int, lost: int) -> None:
    record_partitions_owned(node, owned)
    if gained:
        LEASE_CHANGES.labels("gained").inc(gained)
    if lost:
        LEASE_CHANGES.labels("lost").inc(lost)


def record_reaped(ended: Iterable[Any]) -> None:
    """Rows the reaper ended: ``retry_at`` set means another attempt, else the run failed for good."""
    for row in ended:
        if row["retry_at"] is None:
            RUNS_FINISHED.labels(str(RunStatus.FAILED)).inc()
        else:
            REAPER_REQUEUED.inc()
            RETRIES.labels("reaper").inc()


def record_claims(claimed: Iterable[ClaimedRun]) -> None:
    """Start lag of first attempts (a retry's start is late by design: its backoff)."""
    observe_many(START_LAG, [max(0.0, (run.started_at - run.scheduled_at).total_seconds())
                             for run in claimed if run.attempt == 1])


def record_outcomes(batch: Iterable[Completion], accepted: set[Any]) -> None:
    """Outcomes the database accepted: task durations, retries and final statuses."""
    durations: dict[tuple[str, str], list[float]] = {}  # by label set: each child looked up once a batch
    finished: dict[str, int] = {}
    retries = 0
    for done in batch:
        if done.run.run_id not in accepted:
            continue
        # bounded(), inline: this runs for every outcome
        task_type = str((done.run.task or {}).get("type", "none"))
        task_type = task_type if task_type in TASK_TYPES else OTHER
        status = str(done.outcome.status)
        status = status if status in OUTCOME_STATUSES else OTHER
        durations.setdefault((task_type, status), []).append(
            max(0.0, (done.finished_at - done.run.started_at).total_seconds()))
        if done.retry_at is not None:
            retries += 1
        else:
            finished[status] = finished.get(status, 0) + 1
    for labels, amounts in durations.items():
        observe_many(TASK_DURATION.labels(*labels), amounts)
    if retries:
        RETRIES.labels("worker").inc(retries)
    for status, count in finished.items():
        RUNS_FINISHED.labels(status).inc(count)


async def collect_fleet(pool: Pool, *shards: Pool) -> None:
    """Read the fleet-wide gauges from the database, and with shards from each shard too, added up
    (chimes.store.dashboard.add_up); the API calls this on every scrape."""
    gauges = await fleet_gauges(pool)
    if shards:
        gauges = add_up([gauges, *await asyncio.gather(*(fleet_gauges(shard) for shard in shards))])
    for tier in gauges.queue:
        QUEUE_DEPTH.labels(tier.tier).set(tier.depth)
        QUEUE_OLDEST.labels(tier.tier).set(tier.oldest_sec or 0.0)
    LIVE_NODES.set(gauges.nodes)
    LIVE_WORKERS.set(gauges.workers)
    PARTITIONS_UNLEASED.set(gauges.unleased)
    record_move(await move_under_way(pool))


def record_move(move: Move | None) -> None:
    """The gauges of the move under way (the catalog's), or none: every phase 0."""
    for phase in PHASES_UNDER_WAY:
        MOVE_PHASE.labels(phase).set(1 if move is not None and move.phase == phase else 0)
    MOVE_FENCED.set((move.fenced_sec or 0.0) if move is not None else 0.0)
    MOVE_HEARTBEAT_AGE.set((move.heartbeat_age_sec or 0.0) if move is not None else 0.0)


def exposition() -> tuple[bytes, str]:
    """The text format of every metric in this process, and its content type."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def serve(port: int, host: str) -> None:
    """Serve ``/metrics`` on its own port (scheduler and worker processes), from a daemon thread."""
    _start_http_server(port, addr=host)


class LatencyMiddleware:
    """Times every HTTP request by method, route template (``/jobs/{job_id}``) and status. Anyone may
    send a request, so each label is bounded: a made-up method is ``other``, a path no route matched is
    ``unmatched`` (never the raw path), a status outside 100-599 is ``other``."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            API_LATENCY.labels(bounded(scope["method"], HTTP_METHODS), _route_template(scope),
                               status_label(status)).observe(time.perf_counter() - started)


def _route_template(scope: dict[str, Any]) -> str:
    """The template of the route that handled the request: one of the app's, so a fixed set."""
    template = getattr(scope.get("route"), "path", None)
    return template if isinstance(template, str) and template.startswith("/") else UNMATCHED
