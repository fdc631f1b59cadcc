"""The dashboard's pure helpers: relative times, durations, next fires, masking, ranges, timelines."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from chimes.dashboard import views

NOW = datetime(2026, 3, 7, 12, 0, 0, tzinfo=UTC)
JOB = uuid.UUID(int=7)


@pytest.mark.parametrize("offset, text", [
    (0.4, "just now"), (12, "12 s ago"), (-5, "in 5 s"), (125, "2 min ago"), (-7300, "in 2 h"), (3 * 86400, "3 d ago"),
])
def test_ago(offset: float, text: str) -> None:
    assert views.ago(NOW - timedelta(seconds=offset), NOW) == text
    assert views.ago(None, NOW) == "—"


@pytest.mark.parametrize("seconds, text", [
    (0.0854, "85 ms"), (1.44, "1.4 s"), (42, "42 s"), (125, "2 min 5 s"), (120, "2 min"), (3 * 3600 + 240, "3 h 4 min"),
    (-1, "0 ms"), (None, "—"),
])
def test_duration(seconds: float | None, text: str) -> None:
    assert views.duration(seconds) == text


def test_next_fires_follow_the_cron_in_its_time_zone_from_the_pending_trigger() -> None:
    definition = {"schedule": {"cron": "30 2 * * *", "timezone": "America/New_York"}}
    first = datetime(2026, 3, 7, 7, 30, tzinfo=UTC)  # 02:30 EST
    fires = views.next_fires(definition, first, JOB, count=3)
    # 2026-03-08 02:30 does not exist in New York: it runs at 03:00 EDT (07:00Z), then 02:30 EDT.
    assert fires == [first, datetime(2026, 3, 8, 7, 0, tzinfo=UTC), datetime(2026, 3, 9, 6, 30, tzinfo=UTC)]
    assert views.next_fires({"schedule": {"at": first}}, first, JOB) == [first]
    assert views.next_fires(definition, None, JOB) == []


def test_secret_looking_headers_and_env_are_masked() -> None:
    shown = dict(views.masked({"Authorization": "Bearer x", "X-Api-Key": "k", "Accept": "text/plain",
                               "DB_PASSWORD": "p"}))
    assert shown == {"Authorization": views.MASK, "X-Api-Key": views.MASK, "Accept": "text/plain",
                     "DB_PASSWORD": views.MASK}


def test_task_summary_and_schedule_text() -> None:
    assert views.task_summary({"type": "http", "method": "GET", "url": "https://x/y"}) == "GET https://x/y"
    assert views.task_summary({"type": "command", "argv": ["sh", "-c", "echo hi"]}) == "sh -c 'echo hi'"
    assert views.schedule_text({"schedule": {"cron": "@daily", "timezone": "UTC"}}) == "@daily (UTC)"
    assert views.schedule_text({"schedule": {"at": NOW}}) == "once at 2026-03-07 12:00:00 UTC"


def test_clock_shows_the_date_only_when_it_is_not_today() -> None:
    assert views.clock(NOW + timedelta(seconds=5), NOW) == "12:00:05"
    assert views.clock(NOW + timedelta(days=1), NOW) == "Mar 08 12:00:00"
    assert views.clock(NOW + timedelta(days=400), NOW) == "2027-04-11 12:00"


def test_partition_ranges() -> None:
    assert views.partition_ranges([7, 0, 1, 2, 9, 10]) == "0\u20132, 7, 9\u201310"
    assert views.partition_ranges([]) == ""


def test_lag_bars_label_every_bucket_and_scale_to_the_tallest() -> None:
    found = views.lag_bars([0.1, 1.0], [5, 10, 0])
    assert [b.label for b in found] == ["< 0.1 s", "0.1\u20131 s", "\u2265 1 s"]
    assert [b.percent for b in found] == [50.0, 100.0, 0.0]


def test_minute_bars_include_empty_minutes() -> None:
    outside = [{"minute": NOW.replace(hour=11, minute=50), "failed": 4}]
    found = views.minute_bars(outside, NOW + timedelta(seconds=30), 3)
    assert [(b.label, b.value) for b in found] == [("11:58", 0), ("11:59", 0), ("12:00", 0)]
    found = views.minute_bars([{"minute": NOW - timedelta(minutes=1), "failed": 4}], NOW, 3)
    assert [(b.label, b.value) for b in found] == [("11:58", 0), ("11:59", 4), ("12:00", 0)]


def test_timeline_places_each_attempt_and_lists_what_happened() -> None:
    start = NOW
    run = {"scheduled_at": start, "fired_at": start + timedelta(seconds=0.2),
           "finished_at": start + timedelta(seconds=10), "status": "succeeded"}
    attempts = [
        {"attempt": 1, "status": "failed", "started_at": start + timedelta(seconds=1),
         "finished_at": start + timedelta(seconds=2)},
        {"attempt": 2, "status": "succeeded", "started_at": start + timedelta(seconds=5),
         "finished_at": start + timedelta(seconds=10)},
    ]
    spans, events = views.timeline(run, attempts, NOW + timedelta(minutes=1))
    assert [(s.kind, s.left, s.width) for s in spans] == [("attempt-failed", 10.0, 10.0),
                                                          ("attempt-succeeded", 50.0, 50.0)]
    assert [e.label for e in events] == ["scheduled", "fired", "attempt 1 started", "attempt 1 failed",
                                         "attempt 2 started", "attempt 2 succeeded"]


def test_timeline_of_a_running_run_ends_now() -> None:
    run = {"scheduled_at": NOW, "fired_at": NOW, "finished_at": None, "status": "running"}
    running = [{"attempt": 1, "status": "running", "started_at": NOW + timedelta(seconds=2), "finished_at": None}]
    spans, events = views.timeline(run, running, NOW + timedelta(seconds=4))
    assert [(s.left, s.width) for s in spans] == [(50.0, 50.0)]
    assert events[-1].label == "attempt 1 started"
