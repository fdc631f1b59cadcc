"""A process that loses its database says so once, and once when it has it back, not once per failure."""

from __future__ import annotations

import logging

import pytest

from chimes import outage


@pytest.fixture(autouse=True)
def no_outage() -> None:
    outage._current = None


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "chimes.database" and r.levelno >= logging.WARNING]


def test_an_outage_is_logged_when_it_starts_and_when_it_ends(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    for step in ("scan", "fire", "sync_leases") * 20:
        outage.failed(step, "ConnectionRefusedError: [Errno 111] Connection refused")
    assert outage.current() is not None and outage.current().failures == 60
    outage.connected("10.0.0.2:5432")
    outage.connected("10.0.0.2:5432")  # the pool's other connections: nothing more to say
    logged = messages(caplog)
    assert len(logged) == 2, logged
    assert logged[0].startswith("database unavailable: scan failed: ConnectionRefusedError")
    assert logged[1].startswith("database back: connected to 10.0.0.2:5432 after ")
    assert logged[1].endswith("(60 failed steps)")
    assert outage.current() is None


def test_a_long_outage_is_summed_up_now_and_then(caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(outage.time, "monotonic", lambda: clock[0])
    caplog.set_level(logging.WARNING)
    for _ in range(100):
        outage.failed("claim", "TimeoutError")
        clock[0] += 1.0  # a failure a second for 100 s: a reminder every 30 s
    assert len(messages(caplog)) == 1 + 3


def test_failures_far_apart_are_separate_outages(caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(outage.time, "monotonic", lambda: clock[0])
    caplog.set_level(logging.WARNING)
    outage.failed("claim", "statement timeout")
    clock[0] += outage.QUIET_SEC + 1  # the steps in between succeeded on connections already open
    outage.failed("claim", "statement timeout")
    assert [m.split(":")[0] for m in messages(caplog)] == ["database unavailable", "database unavailable"]
