"""What tracing costs when it is off: python -m bench.tracing_off (a few seconds, one core).

Times the hooks a run passes through (claim, attempt, complete, fire), the API's create span and the
``traceparent`` every HTTP call carries, best of seven rounds of 100,000 calls each.
"""

from __future__ import annotations

import timeit
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from chimes import tracing
from chimes.worker.tasks import http
from chimes.worker.tasks.common import TaskContext


def best_ns(call: Callable[[], Any], number: int = 100_000) -> float:
    return min(timeit.repeat(call, number=number, repeat=7)) / number * 1e9


def main() -> None:
    assert not tracing.enabled(), "unset OTEL_* to measure the off path"
    run_id = str(uuid.uuid4())
    run: Any = type("Run", (), {"run_id": uuid.uuid4(), "job_id": uuid.uuid4(), "attempt": 1})()

    def hooks() -> None:
        tracing.claimed([run], "worker")
        with tracing.attempt(run, "http") as traced:
            traced.outcome("succeeded", None)
        tracing.completed([], [])
        tracing.fired([], False)

    def create_span() -> None:
        with tracing.span("chimes.job.create", None) as attributes:
            attributes["chimes.job_id"] = run_id

    ctx = TaskContext(run_id, run_id, 1, datetime.now(UTC), 10.0)
    print(f"hooks per run (claim, attempt, complete, fire): {best_ns(hooks):.0f} ns")
    print(f"create span: {best_ns(create_span):.0f} ns")
    print(f"traceparent: {best_ns(lambda: tracing.traceparent(run_id, 2)):.0f} ns")
    print(f"build_headers with it: {best_ns(lambda: http.build_headers({'A': 'b'}, ctx)):.0f} ns")


if __name__ == "__main__":
    main()
