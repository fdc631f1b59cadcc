"""Traces through a real API, scheduler node, worker and target: one run, its spans and its traceparent."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from chimes import tracing
from tests.helpers import wait_for
from tests.integration.fleet import Fleet
from tests.target import Target

RUN_SPANS = ["chimes.fire", "chimes.claim", "chimes.attempt", "chimes.complete"]


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.configure(provider)
    yield exporter
    tracing.configure(None)
    provider.shutdown()


def spans_named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


async def test_a_run_is_one_trace_from_create_to_the_target(
    exporter: InMemorySpanExporter, fleet: Fleet, client: httpx.AsyncClient, target: Target
) -> None:
    target.responders["/flaky"] = lambda n: 503 if n == 1 else 200
    at = (datetime.now(UTC) + timedelta(seconds=0.3)).isoformat()
    job = {"name": "traced", "schedule": {"at": at},
           "retryPolicy": {"maxAttempts": 2, "initialBackoffSec": 0.1, "jitter": 0},
           "task": {"type": "http", "url": target.url + "/flaky", "headers": {"traceparent": "00-forged"}}}
    caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    created = await client.post("/jobs", json=job, headers={"traceparent": caller})
    job_id = created.json()["jobId"]
    await wait_for(lambda: len(spans_named(exporter, "chimes.complete")) == 2, timeout=15,
                   what="both attempts to complete")

    [create] = spans_named(exporter, "chimes.job.create")
    assert create.attributes is not None and create.attributes["chimes.job_id"] == job_id
    assert create.parent is not None and f"{create.parent.span_id:016x}" == "b7ad6b7169203331"  # the caller's
    assert f"{create.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"

    first, second = target.calls_to("/flaky")
    run_id = first.run_id
    trace_id = run_id.replace("-", "")
    run_spans = [s for s in exporter.get_finished_spans() if s.name in RUN_SPANS]
    assert {f"{s.context.trace_id:032x}" for s in run_spans} == {trace_id}  # one trace per run
    assert sorted(s.name for s in run_spans) == sorted(RUN_SPANS * 2)  # fired, then re-enqueued for the retry
    fires = [s.attributes["chimes.retry"] for s in spans_named(exporter, "chimes.fire")]  # type: ignore[index]
    assert sorted(fires) == [False, True]
    attempts = sorted(spans_named(exporter, "chimes.attempt"), key=lambda s: s.attributes["chimes.attempt"])  # type: ignore[index]
    assert [s.attributes["chimes.outcome"] for s in attempts] == ["failed", "succeeded"]  # type: ignore[index]
    # Each call carries its attempt span as parent, not the task's own header.
    for call, span in zip((first, second), attempts, strict=True):
        assert call.headers["traceparent"] == f"00-{trace_id}-{span.context.span_id:016x}-01"
    statuses = [s.attributes["chimes.status"] for s in spans_named(exporter, "chimes.complete")]  # type: ignore[index]
    assert sorted(statuses) == ["failed", "succeeded"]
