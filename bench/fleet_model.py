"""``python -m bench fleet-model``: the fleet a rate of runs needs (50,000 a second by default), worked
out from what one run costs each process in a burst measured here, and that arithmetic checked on
this machine.

**The costs.** A burst of ``--runs`` through one scheduler node and one worker, the fleet of
``python -m bench burst``: each process's CPU seconds divided by the runs, the scheduler node's,
the worker's, PostgreSQL's and the HTTP target's. A process uses one core at most, so a rate needs
as many processes of a role as the rate times that role's CPU a run, and as many database cores as
the rate times the database's (docs/scaling.md).

**The check.** The same burst through one node and each of ``--check-workers`` workers. Each
burst's drain is set beside two shortest drains, as the model has it (a process on a core of its
own, every process's CPU sharing the machine's cores): the one its own CPU from the due instant
allows (its busiest process's seconds, or all of it spread over the cores), which says how much the
fleet waits beyond its CPU (a claim's round trip, a core taken by another process); and the forecast
from the first burst's costs counted from the due instant (the node fires a large instant ahead of
it), which also says whether a run costs each process the same in a larger fleet. On this
machine's two cores the forecast moves with the machine's speed from one burst to the next as much
as with the fleet; on a larger machine the same command checks fleets that a worker, not the
machine, bounds.
"""

from __future__ import annotations

import math
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from bench.chimes_runs import FleetShape, end_to_end
from bench.env import Env
from bench.report import Result
from bench.target import TargetProcess

HEADROOM = 1.5  # the fleet beside the bare arithmetic, as docs/scaling.md sizes it


@dataclass(frozen=True)
class RunCosts:
    """CPU seconds one run costs each kind of process."""

    scheduler: float
    worker: float
    database: float | None  # None: a server whose CPU is not read here (--database-url)
    target: float

    @property
    def machine(self) -> float:
        """What one run costs a machine that runs all of them."""
        return self.scheduler + self.worker + (self.database or 0.0) + self.target


def run_costs(cpu: Mapping[str, float], runs: int) -> RunCosts:
    """From CPU seconds by process (``scheduler``, ``worker``, ``worker2``, ..., ``postgresql``,
    ``target``) over ``runs`` runs."""

    def summed(prefix: str) -> float:
        return sum(sec for name, sec in cpu.items() if name.startswith(prefix))

    return RunCosts(summed("scheduler") / runs, summed("worker") / runs,
                    cpu["postgresql"] / runs if "postgresql" in cpu else None, cpu.get("target", 0.0) / runs)


@dataclass(frozen=True)
class FleetPlan:
    rate: float  # runs a second
    nodes: int
    workers: int
    database_cores: float | None


def fleet_for(costs: RunCosts, rate: float, headroom: float = 1.0) -> FleetPlan:
    """Scheduler nodes and workers (a core each) and database cores that keep up with ``rate``."""
    return FleetPlan(rate, _whole(rate * costs.scheduler * headroom), _whole(rate * costs.worker * headroom),
                     None if costs.database is None else rate * costs.database * headroom)


def _whole(cores: float) -> int:
    """The processes that give ``cores`` of CPU: 5.000000000000001 (a float's error) is 5, not 6."""
    return max(1, math.ceil(round(cores, 6)))


def predicted_drain(costs: RunCosts, runs: int, workers: int, cores: int) -> tuple[float, str]:
    """The shortest drain that ``costs`` (from the due instant) allow ``workers`` workers on ``cores``
    cores, and what sets it."""
    return _longest({"a worker's core": runs / workers * costs.worker,
                     "the machine's cores": runs * costs.machine / cores})


def cpu_bound(cpu_from_due: Mapping[str, float], cores: int, servers: Sequence[str] = ("postgresql",)) -> tuple[
        float, str]:
    """The shortest drain that the CPU a burst used from its due instant allows: the seconds of its
    busiest process (each runs on one core; not the database ``servers``, whose backends are
    processes of their own), or every process's over the cores."""
    one_core = {name: sec for name, sec in cpu_from_due.items() if name not in servers}
    busiest = max(one_core, key=lambda name: one_core[name])
    return _longest({f"the {busiest}'s core": one_core[busiest],
                     "the machine's cores": sum(cpu_from_due.values()) / cores})


def _longest(bounds: dict[str, float]) -> tuple[float, str]:
    bound = max(bounds, key=lambda name: bounds[name])
    return bounds[bound], bound


def machine_cores() -> int:
    return len(os.sched_getaffinity(0))


async def fleet_model(env: Env, target: TargetProcess, *, runs: int, check_workers: Sequence[int], concurrency: int,
                      rate: float, say: Callable[[str], None],
                      settle: Callable[[], Awaitable[None]]) -> list[Result]:
    """The burst that gives the costs (one node, one worker), then a burst per entry of ``check_workers``."""
    results = []
    for n, workers in enumerate([1, *check_workers]):
        if n:
            await settle()
        say(f"fleet-model: {'the costs' if not n else 'the check'}, one scheduler node and {workers} worker(s)")
        result = await end_to_end(env, target, runs=runs, spread_sec=0, shape=FleetShape(1, workers, concurrency),
                                  scenario="fleet-model", say=say)
        result.extra["part"] = "check" if n else "costs"
        results.append(result)
    results[0].extra |= {"fleet_rate": rate, "cores": machine_cores()}
    return results


def _cpu(result: Result, *, from_due: bool) -> dict[str, float]:
    cpu = dict(result.extra["cpu_sec_from_due"] if from_due else result.cpu_sec)
    if not from_due:
        cpu["target"] = result.extra["target_cpu_sec"]
    return cpu


def model_table(results: list[Result]) -> str:
    """Per round (``--repeat``): the costs, the fleet for the rate, and each check beside its prediction."""
    starts = [n for n, result in enumerate(results) if result.extra["part"] == "costs"]
    rounds = [results[a:b] for a, b in zip(starts, [*starts[1:], len(results)], strict=True)]
    if len(rounds) == 1:
        return _round_table(rounds[0])
    return "\n\n".join(f"round {n + 1} of {len(rounds)}\n{_round_table(part)}" for n, part in enumerate(rounds))


def _round_table(results: list[Result]) -> str:
    calibration, checks = results[0], results[1:]
    runs, rate, cores = calibration.completed, calibration.extra["fleet_rate"], calibration.extra["cores"]
    whole, from_due = run_costs(_cpu(calibration, from_due=False), runs), run_costs(_cpu(calibration, from_due=True),
                                                                                   runs)

    def ms(sec: float | None) -> str:
        return "-" if sec is None else f"{sec * 1000:.3f}"

    lines = [f"What one run costs, CPU ms (a burst of {runs:,} through one scheduler node and one worker):",
             f"  {'process':<22}{'the whole burst':>16}{'from the due instant':>22}"]
    for label, field in (("scheduler node", "scheduler"), ("worker", "worker"), ("PostgreSQL", "database"),
                         ("HTTP target", "target")):
        lines.append(f"  {label:<22}{ms(getattr(whole, field)):>16}{ms(getattr(from_due, field)):>22}")
    lines.append(f"  {'all of them':<22}{ms(whole.machine):>16}{ms(from_due.machine):>22}")
    bare, sized = fleet_for(whole, rate), fleet_for(whole, rate, HEADROOM)
    database = ("not read (an external server)" if bare.database_cores is None or sized.database_cores is None
                else f"{bare.database_cores:.1f} busy cores ({sized.database_cores:.1f})")
    lines += ["", f"The fleet for {rate:,.0f} runs a second, from the whole burst's costs (with x{HEADROOM} headroom "
                  "in brackets; a process uses one core):",
              f"  scheduler nodes {bare.nodes} ({sized.nodes}), workers {bare.workers} ({sized.workers}), "
              f"PostgreSQL {database}"]
    if checks:
        lines += ["", f"The model checked on this machine ({cores} cores). Each burst's drain beside the shortest that "
                      "its own CPU from the due instant allows (its busiest process's, or all of it over the cores), "
                      "and beside the forecast from the costs above:",
                  f"  {'workers':<8}{'drain':>8}  {'CPU bound':>10}  {'set by':<22}{'drain/bound':>12}{'forecast':>10}"
                  f"{'drain/forecast':>16}{'runs/s':>9}{'worker CPU ms a run':>21}"]
        for check in checks:
            workers, drain = check.extra["fleet"]["workers"], check.drain_sec or 0.0
            bound, bound_by = cpu_bound(check.extra["cpu_sec_from_due"], cores)
            forecast, _ = predicted_drain(from_due, check.completed, workers, cores)
            worker_ms = run_costs(_cpu(check, from_due=True), check.completed).worker * 1000
            lines.append(f"  {workers:<8}{drain:>7.2f}s  {bound:>9.2f}s  {bound_by:<22}{drain / bound:>12.2f}"
                         f"{forecast:>9.2f}s{drain / forecast:>16.2f}{check.throughput or 0:>9,.0f}{worker_ms:>21.3f}")
    return "\n".join(lines)
