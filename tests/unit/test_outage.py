"""A process that loses a database says so once, naming it, and once when it has it back, not once per
failure; with several databases (shards), each one's outage is its own."""

from __future__ import annotations

import logging

import asyncpg
import pytest

from chimes import outage

CATALOG = outage.Database("catalog", "catalog (10.0.0.2:5432/chimes)")
SHARD = outage.Database("shard 2", "shard 2 (10.0.0.3:5432/chimes_2)")


@pytest.fixture(autouse=True)
def no_outage() -> None:
    outage._current.clear()


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "chimes.database" and r.levelno >= logging.WARNING]


def test_an_outage_is_logged_when_it_starts_and_when_it_ends(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    for step in ("scan", "fire", "sync_leases") * 20:
        outage.failed(step, "ConnectionRefusedError: [Errno 111] Connection refused", CATALOG)
    going_on = outage.current()
    assert going_on is not None and going_on.failures == 60 and going_on.database == CATALOG
    outage.connected(CATALOG)
    outage.connected(CATALOG)  # the pool's other connections: nothing more to say
    logged = messages(caplog)
    assert len(logged) == 2, logged
    assert logged[0].startswith("database unavailable: catalog (10.0.0.2:5432/chimes): scan failed: "
                                "ConnectionRefusedError")
    assert logged[1].startswith("database back: connected to catalog (10.0.0.2:5432/chimes) after ")
    assert logged[1].endswith("(60 failed steps)")
    assert outage.current() is None


def test_each_database_has_its_own_outage(caplog: pytest.LogCaptureFixture) -> None:
    """A shard down while the catalog answers: reaching the catalog does not end the shard's outage."""
    caplog.set_level(logging.WARNING)
    outage.failed("claim", "ConnectionRefusedError", SHARD)
    outage.connected(CATALOG)
    assert outage.current() is not None and outage.current().database == SHARD  # type: ignore[union-attr]
    outage.failed("scan", "TimeoutError", CATALOG)
    outage.connected(SHARD)
    assert outage.current() is not None and outage.current().database == CATALOG  # type: ignore[union-attr]
    assert messages(caplog) == [
        "database unavailable: shard 2 (10.0.0.3:5432/chimes_2): claim failed: ConnectionRefusedError (until it "
        "is back, further failures are counted, not logged)",
        "database unavailable: catalog (10.0.0.2:5432/chimes): scan failed: TimeoutError (until it is back, "
        "further failures are counted, not logged)",
        messages(caplog)[2],
    ]
    assert messages(caplog)[2].startswith("database back: connected to shard 2 (10.0.0.3:5432/chimes_2) after ")


def test_a_failure_carries_the_database_it_came_from() -> None:
    lost = asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation")
    assert outage.database_of(lost) is outage.UNKNOWN
    outage.blame(lost, SHARD)
    outage.blame(lost, CATALOG)  # the nearest record stays
    assert outage.database_of(lost) == SHARD
    try:
        raise RuntimeError("a step failed") from lost
    except RuntimeError as wrapped:
        assert outage.database_of(wrapped) == SHARD


def test_a_long_outage_is_summed_up_now_and_then(caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(outage.time, "monotonic", lambda: clock[0])
    caplog.set_level(logging.WARNING)
    for _ in range(100):
        outage.failed("claim", "TimeoutError", CATALOG)
        clock[0] += 1.0  # a failure a second for 100 s: a reminder every 30 s
    logged = messages(caplog)
    assert len(logged) == 1 + 3
    assert all(line.startswith("database still unavailable: catalog (10.0.0.2:5432/chimes), after ")
               for line in logged[1:]), logged


def test_failures_far_apart_are_separate_outages(caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(outage.time, "monotonic", lambda: clock[0])
    caplog.set_level(logging.WARNING)
    outage.failed("claim", "statement timeout", CATALOG)
    clock[0] += outage.QUIET_SEC + 1  # the steps in between succeeded on connections already open
    outage.failed("claim", "statement timeout", CATALOG)
    assert [m.split(":")[0] for m in messages(caplog)] == ["database unavailable", "database unavailable"]
