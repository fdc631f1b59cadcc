"""``python -m bench SCENARIO [options]``: the Chimes benchmarks (docs/benchmarks.md).

Scenarios:
  burst        N one-off HTTP jobs due at one instant, through real scheduler and worker processes
  up           N one-off HTTP jobs created through the API of a plain `chimes up`, due at one instant: its
               default (every role in one process), --processes and --processes --worker-processes 2
               (--modes), alternating; --profile DIR records py-spy on each burst
  top-of-hour  N recurring jobs sharing a cron expression, on top of M idle schedules (scheduler path)
  steady       a rate of runs per second for a duration, end to end
  load         bulk import of N schedules with ``chimes jobs import``
  peers        the same burst through Chimes, PgQueuer, procrastinate and Celery, a no-op task and an HTTP call
               through one client for all, the same processes, runs in flight and finish line, the order
               alternating over --repeat rounds; python -m bench.peer_report FILES combines sittings
  ha-cost      the same burst and API creates on one PostgreSQL, and on Patroni with an asynchronous and
               with a synchronous standby: what the synchronous standby costs
  idle-wal     the WAL an idle fleet writes a second, by relation and kind of record (pg_walinspect)
  async-loss   the primary SIGKILLed while jobs are created and runs fired, asynchronous then synchronous
               standby: what a failover loses (--repeat failovers of each)
  shards       the same burst over 1, 2 and 4 shards (an embedded PostgreSQL each), the API's routing with
               the fewest and the most, and the burst with one shard's PostgreSQL stopped (SIGSTOP)
  move         `chimes shards move 512-1023` to a second embedded PostgreSQL over --schedules schedules while
               every-second jobs fire and a client changes a moving job through the API: the move's phases,
               the fire delays and missing slots, the API's longest write
  http-calls   the HTTP task's client alone: N calls through Chimes' executor (libcurl), through its
               libcurl pool alone and through an aiohttp session with the same headers, each in a
               process of its own: CPU per call
  skip-claim   N queued runs of one owner, then a worker's claims timed on that queue: one of 100 that
               skips nobody, and one skipping the owner (as while it holds its share of the worker)
  claim-plan   N queued runs and --caps tag caps none of them fall under, then one claim of 100 executed
               40 times as a worker executes it (generic plan, rolled back): its time and buffer reads
  fleet-model  the fleet for --fleet-rate runs a second from the CPU a run costs each process in a burst, and
               that model checked here: bursts through --check-workers workers, each drain beside its prediction
  worker-instructions
               the burst with N/4 runs and with N, the worker under valgrind's cachegrind: the
               instructions one run costs the worker, counted (steady where times are not), and by function

Each prints a table; ``--json FILE`` writes the figures, ``--chart FILE.png`` the lag distributions.
Without ``--database-url`` an embedded PostgreSQL is started in a temporary folder and removed after.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
from pathlib import Path
from typing import Any

import orjson

from bench import quiet
from bench.env import describe_machine, environment
from bench.report import Result, spread_table, table


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def _shard_counts(text: str) -> list[int]:
    from bench.shards import parse_counts

    try:
        return parse_counts(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated whole numbers, not {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"each must be 1 or more, not {text!r}")
    return counts


def _identifier(text: str) -> str:
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,39}", text):
        raise argparse.ArgumentTypeError(f"lower-case letters, digits and _ (40 at most), not {text!r}")
    return text


def _folder(text: str) -> Path:
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; give a folder")
    return path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=["burst", "up", "top-of-hour", "steady", "load", "peers", "ha-cost",
                                             "idle-wal", "async-loss", "shards", "http-calls", "move",
                                             "skip-claim", "claim-plan", "fleet-model", "worker-instructions"])
    parser.add_argument("--database-url", default=os.environ.get("BENCH_DATABASE_URL"),
                        help="a PostgreSQL server to use (a database per system is created on it)")
    parser.add_argument("--database-prefix", type=_identifier, default="bench",
                        help="name prefix of the databases created on the server (two benchmarks can share one)")
    parser.add_argument("--runs", type=int, default=10_000,
                        help="runs in the burst (burst, up, top-of-hour, peers, ha-cost, fleet-model, "
                             "worker-instructions), calls (http-calls), queued runs (skip-claim, claim-plan)")
    parser.add_argument("--caps", type=int, default=0,
                        help="claim-plan: tag concurrency caps to create, none of which the queued runs fall under")
    parser.add_argument("--creates", type=_positive, default=300,
                        help="jobs created through the API one at a time, for their latency (ha-cost, shards)")
    parser.add_argument("--shards", type=_shard_counts, default="1,2,4",
                        help="shards: the configurations, comma-separated numbers of PostgreSQL servers")
    parser.add_argument("--lanes", type=_positive, default=8,
                        help="writers creating jobs through the API at once, as fast as it answers (async-loss)")
    parser.add_argument("--schedules", type=_positive, default=1_000_000,
                        help="recurring jobs in the catalog before the move, spread over every partition (move)")
    parser.add_argument("--idle", type=int, default=0, help="idle schedules in the index (top-of-hour)")
    parser.add_argument("--rate", type=float, default=1000.0, help="runs per second (steady)")
    parser.add_argument("--duration", type=float, default=30.0,
                        help="seconds (steady, idle-wal); move: of slots counted before the move and after it")
    parser.add_argument("--jobs", type=int, default=100_000, help="schedules to import (load)")
    parser.add_argument("--workers", type=int, default=1, help="chimes worker processes (peers: every system's)")
    parser.add_argument("--concurrency", type=int, default=200,
                        help="runs each chimes worker executes at once (http-calls: calls at once)")
    parser.add_argument("--schedulers", type=int, default=1, help="chimes scheduler processes")
    parser.add_argument("--check-workers", type=_counts, default="1,2",
                        help="fleet-model: the fleets the model is checked with, comma-separated numbers of workers")
    parser.add_argument("--fleet-rate", type=float, default=50_000.0,
                        help="fleet-model: the runs a second the fleet is worked out for")
    parser.add_argument("--systems", default="chimes,pgqueuer,procrastinate,celery",
                        help="peers: the systems, comma-separated")
    parser.add_argument("--variants", default="noop,http",
                        help="peers: the tasks, comma-separated: noop (nothing), http (one call through one client)")
    parser.add_argument("--in-flight", type=_positive, default=200,
                        help="peers: the runs each system holds in flight at once, shared evenly by its --workers "
                             "processes")
    parser.add_argument("--hold-ms", type=float, default=10.0,
                        help="peers: how long the target holds each call, so that the calls in flight overlap there "
                             "and are counted")
    parser.add_argument("--modes", default="processes,single-process",
                        help="up: the layouts of `chimes up` to run, comma-separated: single-process, processes, "
                             "2-workers")
    parser.add_argument("--profile", type=_folder,
                        help="up: record py-spy on `chimes up` and its children during each burst, into this folder")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the scenario this many times (async-loss: failovers in each mode; peers: rounds, "
                             "the systems' order alternating)")
    parser.add_argument("--standby-stall", type=float, default=0.5,
                        help="async-loss: also fail over after the primary's WAL sender has been stopped this many "
                             "seconds (a stalled link between zones); 0 for plain kills only")
    parser.add_argument("--settle", type=float, default=120.0,
                        help="before each round (peers: each system), wait up to this many seconds for the 1-minute "
                             "load average to fall to 0.5 per core; 0: start at once")
    parser.add_argument("--statements", action="store_true",
                        help="load pg_stat_statements (embedded server) and report the database time by statement")
    parser.add_argument("--distinct-urls", action="store_true",
                        help="http-calls: each call to a URL of its own, as each of up's jobs calls, parsed once each")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--chart", type=Path, help="write a PNG of the start-lag distributions here")
    return parser


async def _run(args: argparse.Namespace) -> tuple[dict[str, Any], list[Result], list[quiet.Quietness]]:
    from bench.chimes_runs import FleetShape
    from bench.target import TargetProcess

    shape = FleetShape(args.schedulers, args.workers, args.concurrency)
    with environment(args.database_url, args.statements, args.database_prefix) as env:
        machine = await describe_machine(env)
        results: list[Result] = []
        target = TargetProcess(env.workdir)
        rounds: list[quiet.Quietness] = []
        try:
            # top-of-hour repeats its burst on one seeded index itself, async-loss its failovers on one cluster
            # up alternates its two modes over the rounds itself
            once = ("top-of-hour", "async-loss", "up", "peers")
            for attempt in range(1 if args.scenario in once else args.repeat):
                if args.repeat > 1 and args.scenario not in once:
                    say(f"round {attempt + 1} of {args.repeat}")
                await _settle(args.settle)
                async with quiet.watch() as quietness:
                    found = await _scenario(args, env, target, shape)
                results += found
                rounds.append(quietness)
                say(f"machine: {quietness.describe()}")
        finally:
            target.stop()
        machine["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        machine["rounds"] = [{"round": n + 1} | q.to_json() for n, q in enumerate(rounds)]
    return machine, results, rounds


async def _settle(limit_sec: float) -> None:
    if limit_sec > 0:
        waited = await quiet.settle(limit_sec)
        if waited:
            say(f"waited {waited:.0f}s for the load average to settle (1-minute: {os.getloadavg()[0]:.2f})")


async def _scenario(args: argparse.Namespace, env: Any, target: Any, shape: Any) -> list[Result]:
    from bench import chimes_runs

    if args.scenario == "burst":
        return [await chimes_runs.end_to_end(env, target, runs=args.runs, spread_sec=0, shape=shape,
                                             scenario="burst", say=say)]
    if args.scenario == "up":
        from bench.up_burst import up_bursts

        return await up_bursts(env, target, runs=args.runs, rounds=args.repeat, say=say,
                               modes=args.modes.split(","), profile=args.profile)
    if args.scenario == "steady":
        runs = int(args.rate * args.duration)
        return [await chimes_runs.end_to_end(env, target, runs=runs, spread_sec=args.duration, shape=shape,
                                             scenario="steady", say=say)]
    if args.scenario == "top-of-hour":
        from bench.top_of_hour import top_of_hour

        return await top_of_hour(env, runs=args.runs, idle=args.idle, shape=shape, say=say, rounds=args.repeat)
    if args.scenario == "ha-cost":
        from bench.ha_cost import ha_cost

        return await ha_cost(env, target, runs=args.runs, creates=args.creates, shape=shape, say=say)
    if args.scenario == "async-loss":
        from bench.async_loss import async_loss

        return await async_loss(env, target, rounds=args.repeat, lanes=args.lanes, say=say,
                                stall_sec=args.standby_stall)
    if args.scenario == "shards":
        from bench.shards import shards

        return await shards(env, target, runs=args.runs, counts=args.shards, creates=args.creates, shape=shape,
                            say=say)
    if args.scenario == "idle-wal":
        from bench.idle_wal import idle_wal

        return [await idle_wal(env, duration=args.duration, shape=shape, say=say)]
    if args.scenario == "move":
        from bench.move import move

        return await move(env, target, schedules=args.schedules, window_sec=args.duration, say=say)
    if args.scenario == "http-calls":
        from bench.http_calls import http_calls

        return await http_calls(target.url, runs=args.runs, concurrency=args.concurrency,
                                distinct_urls=args.distinct_urls, say=say)
    if args.scenario == "worker-instructions":
        from bench.instructions import worker_instructions

        return [await worker_instructions(env, target, runs=args.runs, concurrency=args.concurrency, say=say)]
    if args.scenario == "skip-claim":
        from bench.skip_claim import skip_claim

        return [await skip_claim(env, runs=args.runs, say=say)]
    if args.scenario == "claim-plan":
        from bench.claim_plan import claim_plan

        return [await claim_plan(env, runs=args.runs, caps=args.caps, say=say)]
    if args.scenario == "fleet-model":
        from bench.fleet_model import fleet_model

        return await fleet_model(env, target, runs=args.runs, check_workers=args.check_workers,
                                 concurrency=args.concurrency, rate=args.fleet_rate, say=say,
                                 settle=functools.partial(_settle, args.settle))
    if args.scenario == "load":
        from bench.load import load

        return [await load(env, jobs=args.jobs, say=say)]
    from bench.peers import Layout, peers

    return await peers(env, target, runs=args.runs, systems=args.systems.split(","),
                       variants=args.variants.split(","), layout=Layout(args.workers, args.in_flight, args.hold_ms),
                       rounds=args.repeat, say=say, settle=functools.partial(_settle, args.settle))


def _report(scenario: str, results: list[Result]) -> str:
    if scenario == "peers":
        from bench.peer_report import sitting_table

        return sitting_table(results)
    if scenario == "ha-cost":
        from bench.ha_cost import cost_table

        return cost_table(results)
    if scenario == "async-loss":
        from bench.async_loss import loss_table, rounds_of

        return loss_table(rounds_of(results))
    if scenario == "shards":
        from bench.shards import shards_table

        return shards_table(results)
    if scenario == "move":
        from bench.move import move_table

        return move_table(results)
    if scenario == "worker-instructions":
        from bench.instructions import instructions_table

        return instructions_table(results)
    if scenario == "skip-claim":
        from bench.skip_claim import skip_table

        return skip_table(results)
    if scenario == "claim-plan":
        from bench.claim_plan import plan_table

        return plan_table(results)
    if scenario == "fleet-model":
        from bench.fleet_model import model_table

        return model_table(results)
    if scenario == "idle-wal":
        from bench.idle_wal import wal_table

        return wal_table(results[0])
    return table(results)


def _quietness(rounds: list[quiet.Quietness]) -> str:
    """A line per round on how quiet the machine was, and a warning when it was not."""
    lines = [f"  {f'round {n + 1}' if len(rounds) > 1 else 'machine'}: {q.describe()}" for n, q in enumerate(rounds)]
    busy = [n + 1 for n, q in enumerate(rounds) if q.busy]
    if busy:
        which = "every round" if len(busy) == len(rounds) else "round " + ", ".join(map(str, busy))
        lines.append(f"WARNING: the machine was busy during {which}: wall-clock figures (drain, runs/s, lags) are "
                     "not comparable with a quiet machine's; compare ratios measured in the same command, and CPU "
                     "seconds per 1,000 runs")
    spread = quiet.probe_spread(rounds)
    if spread:
        lines.append(spread)
    return "\n".join(lines)


def _command(argv: list[str] | None) -> str:
    """The command as it was typed, for a figure to be published beside."""
    import shlex

    return shlex.join(["python", "-m", "bench", *(sys.argv[1:] if argv is None else argv)])


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.scenario in ("shards", "move") and args.database_url:
        parser.error(f"{args.scenario} starts embedded PostgreSQL servers of its own, one per shard: drop "
                     "--database-url (and BENCH_DATABASE_URL)")
    if args.scenario == "peers":  # before any server starts
        from bench.peers import Layout
        from bench.peers import argument_problem as peers_problem

        problem = peers_problem(args.systems.split(","), args.variants.split(","),
                                Layout(args.workers, args.in_flight, args.hold_ms))
        if problem:
            parser.error(problem)
    if args.scenario == "worker-instructions":
        from bench.instructions import argument_problem

        problem = argument_problem(args.runs)
        if problem:
            parser.error(problem)
    import uvloop

    machine, results, rounds = uvloop.run(_run(args))
    print(f"\n{args.scenario}: {machine['cores']} cores ({machine['cpu']}), PostgreSQL {machine['postgresql']}, "
          f"load average {machine['load_average_at_start']} -> {machine['load_average_at_end']}")
    print(_report(args.scenario, results))
    print(_quietness(rounds))
    spreads = spread_table(results) if args.scenario != "peers" else ""  # peers: the paired ratios instead
    if spreads:
        print(spreads)
    if args.json:
        args.json.write_bytes(orjson.dumps({"scenario": args.scenario, "command": _command(argv), "args": vars(args) | {
            "json": str(args.json), "chart": str(args.chart)}, "machine": machine,
            "results": [r.to_json() for r in results]}, option=orjson.OPT_INDENT_2, default=str))
    if args.chart and any(r.start_lags for r in results):
        from bench.chart import lag_chart

        what = "fire lag (the run was created)" if args.scenario == "top-of-hour" else "start lag (the task began)"
        lag_chart(results, args.chart, title=f"{args.scenario}: {what}, {results[0].runs:,} runs", what=what)


if __name__ == "__main__":
    main()
