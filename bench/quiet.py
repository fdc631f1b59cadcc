"""How quiet the machine was: the load average and the CPU steal before and during each round of a
scenario, a warning when it was busy, and the spread of a figure over ``--repeat`` rounds.

Wall-clock figures taken on a busy machine vary by a third from one run to the next
(docs/benchmarks.md), so every scenario records this in one place, ``python -m bench`` itself,
rather than each scenario on its own. *Before* is a one-second sample just before the round starts;
*during* is sampled once a second while it runs. The load average during a round counts the
benchmark's own processes (scheduler, workers, PostgreSQL, the peers), so only the load before a round
says whether something else was running; steal (time the hypervisor gave this virtual machine's CPUs
to others) is nobody's here, before or during.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# A machine is busy when, before a round, more than half its cores' worth of processes wanted the CPU
# (a quiet 2-core machine showed 0.3-0.6), or when the hypervisor took more than 2% of its CPU time.
BUSY_LOAD_PER_CORE = 0.5
BUSY_STEAL_PERCENT = 2.0
SAMPLE_EVERY_SEC = 1.0
PROBE_ITERATIONS = 100_000  # about 5 ms of Python on the 2-core machine
PROBE_SPREAD = 0.10  # rounds whose probes differ by more than this did not run on the same machine, in effect


@dataclass(frozen=True)
class CpuTicks:
    """The machine's CPU time counters (``/proc/stat``, first line), in clock ticks."""

    total: int
    steal: int


def parse_cpu_line(line: str) -> CpuTicks:
    """``cpu  user nice system idle iowait irq softirq steal guest guest_nice``: guest time is already
    counted in user and nice, so it is left out of the total."""
    fields = line.split()
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        raise ValueError(f"not the aggregate cpu line of /proc/stat: {line!r}")
    ticks = [int(x) for x in fields[1:9]]
    return CpuTicks(total=sum(ticks), steal=ticks[7])


def steal_percent(before: CpuTicks, after: CpuTicks) -> float | None:
    """Share of the CPU time between two readings that the hypervisor gave to others; None when no
    time passed between them."""
    total = after.total - before.total
    if total <= 0:
        return None
    return round(100 * (after.steal - before.steal) / total, 2)


def read_cpu_ticks(stat: Path = Path("/proc/stat")) -> CpuTicks | None:
    """None where there is no ``/proc/stat`` (not Linux): steal is then not reported."""
    try:
        with stat.open() as f:
            return parse_cpu_line(f.readline())
    except (OSError, ValueError):
        return None


@dataclass
class Quietness:
    """One round's record: the load averages (1, 5, 15 minutes) and steal before it, the highest
    1-minute load average and the steal over it, and why it counts as busy (empty: quiet)."""

    cores: int
    load_before: list[float]
    steal_before_percent: float | None
    load_during_max: float | None = None
    steal_during_percent: float | None = None
    seconds: float = 0.0
    busy: list[str] = field(default_factory=list)
    probe_ms: float | None = None  # speed_probe_ms() just before the round

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        def pct(value: float | None) -> str:
            return "-" if value is None else f"{value:.1f}%"

        during = "-" if self.load_during_max is None else f"{self.load_during_max:.2f}"
        text = (f"load average {self.load_before[0]:.2f} before (max {during} during, with the benchmark's own "
                f"processes), CPU steal {pct(self.steal_before_percent)} before, {pct(self.steal_during_percent)} "
                f"during")
        if self.probe_ms is not None:
            text += f", speed probe {self.probe_ms:.1f} ms"
        return text + (f"; BUSY: {'; '.join(self.busy)}" if self.busy else "")


def speed_probe_ms(repeat: int = 20, clock: Callable[[], float] = time.perf_counter) -> float:
    """Milliseconds a fixed piece of single-threaded Python takes here, the best of ``repeat``. A
    virtual machine's cores can be given less of the host's time without any of it showing as steal:
    on the 2-core machine of docs/benchmarks.md the same commands ran 20-60% slower an hour apart,
    with steal at 0.0% and the load average at rest both times. A timing taken right before a round
    says whether the machine ran as fast as for the rounds it is compared with."""
    best = math.inf
    for _ in range(repeat):
        started = clock()
        _probe_work()
        best = min(best, clock() - started)
    return round(best * 1000, 2)


def _probe_work() -> int:
    total = 0
    for i in range(PROBE_ITERATIONS):
        total += i * i % 7
    return total


def probe_spread(records: Sequence[Quietness]) -> str | None:
    """A note when the speed probe of some rounds was more than :data:`PROBE_SPREAD` slower than the
    fastest one's: their wall-clock figures and CPU seconds are not comparable with the others'."""
    probes = [q.probe_ms for q in records if q.probe_ms is not None]
    if len(probes) < 2 or max(probes) <= min(probes) * (1 + PROBE_SPREAD):
        return None
    return (f"NOTE: the machine's speed changed between rounds: speed probe {min(probes):.1f} to "
            f"{max(probes):.1f} ms ({max(probes) / min(probes) - 1:.0%} slower at most): compare rounds with "
            "close probes")


def verdict(q: Quietness) -> list[str]:
    """Why the round's figures were taken on a busy machine; empty when it was quiet."""
    reasons = []
    if q.load_before[0] > BUSY_LOAD_PER_CORE * q.cores:
        reasons.append(f"load average {q.load_before[0]:.2f} before the round on {q.cores} cores "
                       f"(more than {BUSY_LOAD_PER_CORE:g} per core)")
    for when, steal in (("before", q.steal_before_percent), ("during", q.steal_during_percent)):
        if steal is not None and steal > BUSY_STEAL_PERCENT:
            reasons.append(f"CPU steal {steal:.1f}% {when} the round (more than {BUSY_STEAL_PERCENT:g}%)")
    return reasons


class _Sampler(threading.Thread):
    """Reads the 1-minute load average once a second, on a thread of its own so that a busy event
    loop does not skip samples."""

    def __init__(self) -> None:
        super().__init__(name="bench-quiet-sampler", daemon=True)
        self.done = threading.Event()
        self.loads: list[float] = []

    def run(self) -> None:
        while not self.done.wait(SAMPLE_EVERY_SEC):
            self.loads.append(os.getloadavg()[0])


async def settle(limit_sec: float, load: Callable[[], float] = lambda: os.getloadavg()[0],
                 cores: int | None = None, sample_sec: float = SAMPLE_EVERY_SEC) -> float:
    """Wait, at most ``limit_sec``, for the 1-minute load average to fall to the quiet limit
    (:data:`BUSY_LOAD_PER_CORE` per core); returns the seconds waited. A round started right after
    the one before it begins in that round's load (a 2-core machine reads 1.0-1.2 after a burst),
    and would be flagged busy for the benchmark's own doing; the load average falls by a tenth about
    every six seconds, so this is usually seconds."""
    quiet_at = BUSY_LOAD_PER_CORE * (cores or os.cpu_count() or 1)
    samples = max(0, round(limit_sec / sample_sec))
    waits = 0
    while load() > quiet_at and waits < samples:
        await asyncio.sleep(sample_sec)
        waits += 1
    return waits * sample_sec


@asynccontextmanager
async def watch(sample_sec: float = SAMPLE_EVERY_SEC) -> AsyncIterator[Quietness]:
    """Measure how quiet the machine is around the block: the record is filled in when it ends."""
    first = read_cpu_ticks()
    await asyncio.sleep(sample_sec)
    start = read_cpu_ticks()
    record = Quietness(cores=os.cpu_count() or 1, load_before=[round(x, 2) for x in os.getloadavg()],
                       steal_before_percent=steal_percent(first, start) if first and start else None,
                       probe_ms=speed_probe_ms())
    sampler = _Sampler()
    t0 = time.monotonic()
    sampler.start()
    try:
        yield record
    finally:
        sampler.done.set()
        await asyncio.to_thread(sampler.join)
        end = read_cpu_ticks()
        loads = [*sampler.loads, os.getloadavg()[0]]
        record.load_during_max = round(max(loads), 2)
        record.steal_during_percent = steal_percent(start, end) if start and end else None
        record.seconds = round(time.monotonic() - t0, 1)
        record.busy = verdict(record)


def spread(values: Sequence[float]) -> tuple[float, float, float] | None:
    """min, median, max; None for fewer than two values (nothing to spread)."""
    if len(values) < 2:
        return None
    return min(values), statistics.median(values), max(values)
