"""Traces: a W3C ``traceparent`` on every HTTP task call, and OpenTelemetry spans when configured.

**One trace per run.** Its trace id is the run id's 128 bits (hex, without dashes), so every process
that touches a run (the node that fires it, each worker attempt, the target) joins the same trace
without passing context through the database, and a run's trace is found from its id alone. Spans
hang under a virtual root span whose id is derived from the run id too. Attempts are spans of that
trace, so retries line up in one view; the target's server span is a child of the attempt's.

**Off unless configured**, with the standard variables: ``OTEL_TRACES_EXPORTER`` (``otlp``,
``console``; ``none`` turns it off) or ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (which mean ``otlp``). The rest (``OTEL_SERVICE_NAME``,
``OTEL_TRACES_SAMPLER``, headers, ...) is read by the OpenTelemetry SDK itself, an optional
dependency (``pip install chimes[otel]``). Off, every hook returns at its first line and the
``traceparent`` is still sent (with the sampled flag set, so a target that samples by its parent
keeps its own traces; its span id then names the attempt: the run's id with the attempt number
folded in). ``configure(provider)`` sets a tracer provider in code (tests use an in-memory one).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any

from chimes.enums import RunStatus, TriggerKind

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer, TracerProvider

    from chimes.store.scheduling import Fire
    from chimes.store.working import ClaimedRun, Completion

__all__ = [
    "attempt",
    "claimed",
    "completed",
    "configure",
    "configure_from_env",
    "enabled",
    "fired",
    "run_trace_id",
    "span",
    "traceparent",
]

log = logging.getLogger(__name__)

_tracer: Tracer | None = None
_SAMPLED = "01"
_TRACE_ID = re.compile(r"(?!0{32})[0-9a-fA-F]{32}")


def enabled() -> bool:
    return _tracer is not None


def configure(provider: TracerProvider | None) -> None:
    """Trace with ``provider`` from now on (None: off)."""
    global _tracer
    _tracer = None if provider is None else provider.get_tracer("chimes")


def configure_from_env(environ: Mapping[str, str] = os.environ) -> bool:
    """Turn tracing on when the ``OTEL_*`` variables ask for it; whether it is on."""
    exporters = [name.strip() for name in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if name.strip()]
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not exporters and endpoint:
        exporters = ["otlp"]
    exporters = [name for name in exporters if name != "none"]
    if not exporters:
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("OTEL_* asks for traces but OpenTelemetry is not installed (pip install chimes[otel])")
        return False
    provider = SdkTracerProvider(resource=Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME",
                                                                                      "chimes")}))
    for name in exporters:
        exporter = _exporter(name)
        if exporter is not None:
            provider.add_span_processor(BatchSpanProcessor(exporter))
    configure(provider)
    log.info("tracing on: exporting spans to %s", ", ".join(exporters))
    return True


def _exporter(name: str) -> Any:
    try:
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            return ConsoleSpanExporter()
        if name == "otlp":
            protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                                      os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"))
            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

                return GrpcExporter()
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter()
    except ImportError as exc:
        log.warning("cannot export traces with %r: %s (pip install chimes[otel])", name, exc)
        return None
    log.warning("unknown OTEL_TRACES_EXPORTER %r: ignored", name)
    return None


def run_trace_id(run_id: object) -> str:
    """The run's trace id, 32 hex digits: its id without dashes (a run id is a UUID; anything else, as
    in tests, is hashed, so that a call never fails over its header)."""
    text = str(run_id).replace("-", "")
    if _TRACE_ID.fullmatch(text) is None:
        return hashlib.sha256(str(run_id).encode()).hexdigest()[:32]
    return text.lower()


def traceparent(run_id: str, attempt: int) -> str:
    """The ``traceparent`` header of an attempt's call: the current attempt span's when tracing is on."""
    # run_trace_id, inline for a run id as the worker has it (a UUID's text): this runs for every call
    trace_id = run_id.replace("-", "")
    if _TRACE_ID.fullmatch(trace_id) is None:
        trace_id = run_trace_id(run_id)
    else:
        trace_id = trace_id.lower()
    if _tracer is not None:
        from opentelemetry import trace

        context = trace.get_current_span().get_span_context()
        if context.is_valid and f"{context.trace_id:032x}" == trace_id:
            return f"00-{trace_id}-{context.span_id:016x}-{int(context.trace_flags):02x}"
    span_id = (int(trace_id[16:], 16) ^ attempt) or 1
    return f"00-{trace_id}-{span_id:016x}-{_SAMPLED}"


def _run_context(run_id: object) -> Any:
    """The context of the run's virtual root span: the parent of every span about the run."""
    from opentelemetry import trace

    trace_id = int(run_trace_id(run_id), 16)
    root = trace.SpanContext(trace_id, (trace_id >> 64) or 1, is_remote=True,
                             trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
    return trace.set_span_in_context(trace.NonRecordingSpan(root))


def _ns(moment: datetime) -> int:
    return int(moment.timestamp() * 1e9)


def _point(name: str, run_id: object, attributes: dict[str, Any], start: datetime | None = None) -> None:
    """A span about one run that ends now (from ``start``, else as it starts)."""
    assert _tracer is not None
    opened = _tracer.start_span(name, context=_run_context(run_id), attributes=attributes,
                                start_time=None if start is None else _ns(start))
    opened.end()


def fired(fires: Sequence[Fire], refused: bool) -> None:
    """``chimes.fire`` per run a fired batch made or re-enqueued for a retry (``chimes.retry``), from the
    trigger's due time to now (its fire lag)."""
    if _tracer is None or refused:
        return

    for fire in fires:
        for run_id in [slot.run_id for slot in fire.slots if slot.outcome == "run"] or [fire.run_id]:
            _point("chimes.fire", run_id, {"chimes.run_id": str(run_id), "chimes.job_id": str(fire.trigger.job_id),
                                           "chimes.retry": fire.trigger.kind == TriggerKind.RETRY},
                   start=fire.trigger.fire_at)


def claimed(runs: Iterable[ClaimedRun], worker_id: str) -> None:
    """``chimes.claim`` per run a worker claimed."""
    if _tracer is None:
        return
    for run in runs:
        _point("chimes.claim", run.run_id, {"chimes.run_id": str(run.run_id), "chimes.job_id": str(run.job_id),
                                            "chimes.attempt": run.attempt, "chimes.worker_id": worker_id})


class _Attempt:
    """The attempt span's handle, a context manager that makes the span current; a shared no-op when
    tracing is off (no generator, no allocation: the off path is an attribute test and two calls)."""

    __slots__ = ("_span", "_use")

    def __init__(self, span: Span | None) -> None:
        self._span = span
        self._use: Any = None

    def __enter__(self) -> _Attempt:
        if self._span is not None:
            from opentelemetry import trace

            self._use = trace.use_span(self._span, end_on_exit=True)
            self._use.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._use is not None:
            self._use.__exit__(*exc_info)

    def outcome(self, status: str, error: str | None) -> None:
        if self._span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        self._span.set_attribute("chimes.outcome", status)
        if status == RunStatus.FAILED:
            self._span.set_status(Status(StatusCode.ERROR, error))


_NO_ATTEMPT = _Attempt(None)


def attempt(run: ClaimedRun, task_type: str | None) -> _Attempt:
    """``chimes.attempt``, current while the task runs (``with``): the HTTP call's ``traceparent`` names it."""
    if _tracer is None:
        return _NO_ATTEMPT
    from opentelemetry import trace

    return _Attempt(_tracer.start_span(
        "chimes.attempt", context=_run_context(run.run_id), kind=trace.SpanKind.CLIENT,
        attributes={"chimes.run_id": str(run.run_id), "chimes.job_id": str(run.job_id),
                    "chimes.attempt": run.attempt, "chimes.task_type": task_type or ""}))


def completed(completions: Iterable[Completion], accepted: Iterable[object]) -> None:
    """``chimes.complete`` per outcome the database accepted."""
    if _tracer is None:
        return
    recorded = set(accepted)
    for done in completions:
        run = done.run
        if run.run_id in recorded:
            _point("chimes.complete", run.run_id, {"chimes.run_id": str(run.run_id), "chimes.job_id": str(run.job_id),
                                                   "chimes.attempt": run.attempt,
                                                   "chimes.status": str(done.outcome.status),
                                                   "chimes.retry": done.retry_at is not None})


class _NoSpan:
    __slots__ = ()

    def __enter__(self) -> dict[str, Any]:
        return {}

    def __exit__(self, *exc_info: Any) -> None:
        return None


_NO_SPAN = _NoSpan()


def span(name: str, headers: Mapping[str, str] | None = None) -> Any:
    """A span around a ``with`` block, child of the caller's ``traceparent`` when ``headers`` carry
    one; the block fills the dict it gets with attributes."""
    if _tracer is None:
        return _NO_SPAN
    return _span(name, headers)


@contextmanager
def _span(name: str, headers: Mapping[str, str] | None) -> Iterator[dict[str, Any]]:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    assert _tracer is not None
    attributes: dict[str, Any] = {}
    context = TraceContextTextMapPropagator().extract(dict(headers)) if headers else None
    with _tracer.start_as_current_span(name, context=context) as opened:
        yield attributes
        opened.set_attributes(attributes)
