"""Tracing's off path and its configuration from the standard OTEL_* variables."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from chimes import tracing

RUN_ID = "01a22c94-42f5-7cc2-9920-1c3890db3e48"
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-01$")


@pytest.fixture(autouse=True)
def off_afterwards() -> Iterator[None]:
    yield
    tracing.configure(None)


def test_off_every_attempt_of_a_run_carries_the_runs_trace() -> None:
    assert not tracing.enabled()
    first, second = (TRACEPARENT.match(tracing.traceparent(RUN_ID, n)) for n in (1, 2))
    assert first and second
    assert first[1] == second[1] == RUN_ID.replace("-", "")
    assert first[2] != second[2] and "0" * 16 not in (first[2], second[2])
    assert tracing.traceparent(RUN_ID, 1) == first[0]  # stable: a call can be matched to its attempt


@pytest.mark.parametrize("environ", [{}, {"OTEL_TRACES_EXPORTER": "none"},
                                     {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"},
                                     {"OTEL_SERVICE_NAME": "chimes"}])
def test_off_unless_an_exporter_is_asked_for(environ: dict[str, str]) -> None:
    assert tracing.configure_from_env(environ) is False
    assert not tracing.enabled()


def test_on_with_an_exporter() -> None:
    assert tracing.configure_from_env({"OTEL_TRACES_EXPORTER": "console"}) is True
    assert tracing.enabled()


def test_an_id_that_is_not_a_uuid_still_gets_a_valid_trace() -> None:
    match = TRACEPARENT.match(tracing.traceparent("run-123", 1))
    assert match and match[1] != "0" * 32
