"""A worker's instructions per run: what a run costs, counted rather than timed.

``python -m bench worker-instructions --runs N``: the burst of ``burst`` twice, with N/4 runs and
with N, through a scheduler and one worker process, the worker under ``valgrind --tool=cachegrind
--cache-sim=no``. Its instructions for the larger burst less those for the smaller, over the runs
between them, are what one more run costs the worker: start-up, idle loops and the claim loop's
first rounds fall out. The machine's speed moves from one round to the next with nothing to show
it (docs/benchmarks.md, "The machine, and how busy it was"); the instructions a process executes
do not as much: rounds of one tree spread by 1 to 2%, where their drains or CPU seconds spread by
a fifth, so two versions of the code that differ by a few percent compare by this figure. Cachegrind
counts user space only: the kernel's work for a run (its sockets, epoll) is not in the figure.
Under valgrind the worker runs about twenty times slower, so the burst's lags and drain are not a
figure here.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from bench import chimes_runs
from bench.env import Env
from bench.report import Result
from bench.target import TargetProcess

SMALLER = 4  # the smaller burst is the larger's quarter


def argument_problem(runs: int) -> str | None:
    """Why ``worker-instructions`` cannot run as asked, told before anything starts; None: it can."""
    if shutil.which("valgrind") is None:
        return "worker-instructions needs valgrind on the PATH (apt-get install valgrind)"
    if runs - max(1, runs // SMALLER) < 300:
        return f"worker-instructions needs --runs 400 or more, not {runs}: its figure is the difference of two bursts"
    return None


def cachegrind_prefix(out_file: Path) -> tuple[str, ...]:
    valgrind = shutil.which("valgrind")
    assert valgrind is not None, "checked by argument_problem"
    return (valgrind, "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out_file}")


def read_counts(out_file: Path) -> tuple[int, Counter[str]]:
    """Cachegrind's total of instructions, and each function's ("file:function")."""
    by_function: Counter[str] = Counter()
    file = key = ""  # key: the current function's name, made once per fn= line, not per counted line
    total = 0
    for line in out_file.read_text(errors="replace").splitlines():
        if line.startswith("fl="):
            file = Path(line[3:]).name
        elif line.startswith("fn="):
            key = f"{file}:{line[3:]}"
        elif line[:1].isdigit():
            fields = line.split()
            if len(fields) >= 2:
                by_function[key] += int(fields[1])
        elif line.startswith("summary:"):
            total = int(line.split()[1])
    return total, by_function


def per_run_costs(smaller: tuple[int, Counter[str]], larger: tuple[int, Counter[str]],
                  runs_between: int) -> tuple[float, list[tuple[str, int]]]:
    """What one more run costs: the larger burst's counts less the smaller's, over the runs between
    them; in all, and by function, most first."""
    (small_total, small_by), (large_total, large_by) = smaller, larger
    functions = [(name, round((large_by[name] - small_by[name]) / runs_between))
                 for name in set(large_by) | set(small_by)]
    functions.sort(key=lambda item: (-item[1], item[0]))
    return (large_total - small_total) / runs_between, functions


async def worker_instructions(env: Env, target: TargetProcess, *, runs: int, concurrency: int, say: Any,
                              top: int = 25) -> Result:
    smaller = max(1, runs // SMALLER)
    counts = {}
    for size in (smaller, runs):
        out_file = env.workdir / f"cachegrind-{size}.out"
        shape = chimes_runs.FleetShape(1, 1, concurrency, worker_prefix=cachegrind_prefix(out_file))
        burst = await chimes_runs.end_to_end(env, target, runs=size, spread_sec=0, shape=shape,
                                             scenario="worker-instructions", say=say)
        if burst.completed != size:
            raise RuntimeError(f"{burst.completed} of {size} runs succeeded")
        counts[size] = read_counts(out_file)
        say(f"worker: {counts[size][0]:,} instructions for a burst of {size:,}")
    per_run, functions = per_run_costs(counts[smaller], counts[runs], runs - smaller)
    say(f"worker: {per_run:,.0f} instructions a run (bursts of {smaller:,} and {runs:,}); the most a run costs:")
    for name, count in functions[:top]:
        say(f"  {count:>9,}  {name}")
    result = Result("chimes worker", "worker-instructions", runs, runs, None,
                    notes="instructions counted by cachegrind in the worker process; no lag or drain figures")
    result.extra = {"instructions_per_run": round(per_run), "bursts": [smaller, runs],
                    "worker_instructions": [counts[smaller][0], counts[runs][0]],
                    "by_function_per_run": functions[:top]}
    return result


def instructions_table(results: list[Result]) -> str:
    lines = ["round | bursts        | worker instructions           | a run"]
    for n, result in enumerate(results):
        small, large = result.extra["bursts"]
        counts = " / ".join(f"{count:,}" for count in result.extra["worker_instructions"])
        lines.append(f"{n + 1:<5} | {small:,} / {large:,} | {counts} | {result.extra['instructions_per_run']:,}")
    return "\n".join(lines)
