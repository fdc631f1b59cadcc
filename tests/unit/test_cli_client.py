"""``chimes jobs`` / ``chimes runs`` against a real local HTTP server that answers like API.md."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from click.testing import CliRunner, Result

from chimes.cli import client
from chimes.cli.client_render import relative, when

TOKEN = "tok-secret"
JOB_ID = "0b6f5a7e-3c1d-4d8e-9f00-1234567890ab"
RUN_ID = "7c0e1f2a-aaaa-bbbb-cccc-0123456789ab"


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any


Answer = tuple[int, Any]


@dataclass
class FakeApi:
    """Records every request; answers from ``routes[(METHOD, path)]``, a canned answer or a function."""

    url: str = ""
    requests: list[Seen] = field(default_factory=list)
    routes: dict[tuple[str, str], Answer | Callable[[Seen], Answer]] = field(default_factory=dict)
    headers: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)  # extra answer headers

    def answer(self, seen: Seen) -> Answer:
        self.requests.append(seen)
        route = self.routes.get((seen.method, seen.path))
        if route is None:
            return 404, {"error": "not_found", "message": f"{seen.path} not found", "field": None}
        return route(seen) if callable(route) else route


def _handler(fake: FakeApi) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            parts = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            body = json.loads(raw) if raw else None
            seen = Seen(self.command, parts.path, parse_qs(parts.query), headers, body)
            status, body = fake.answer(seen)
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in fake.headers.get((self.command, parts.path), {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PATCH = do_DELETE = _serve

        def log_message(self, *_: Any) -> None:
            pass

    return Handler


@pytest.fixture
def api() -> Iterator[FakeApi]:
    fake = FakeApi()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    server.daemon_threads = False  # so server_close() joins the handler threads
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02})
    thread.start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def invoke(group: Any, args: list[str], fake: FakeApi | None = None, *, token: str | None = TOKEN,
           url: str | None = None, stdin: str | None = None) -> Result:
    env = {"CHIMES_TOKEN": token, "CHIMES_API_URL": url or (fake.url if fake else None), "COLUMNS": "250"}
    return CliRunner().invoke(group, args, env=env, input=stdin)


def job(n: int, **extra: Any) -> dict[str, Any]:
    return {"jobId": f"job-{n}", "owner": "data", "name": f"job number {n}",
            "schedule": {"cron": "0 2 * * *", "timezone": "Europe/Berlin"},
            "task": {"type": "http", "method": "POST", "url": "https://example.test/"},
            "paused": False, "version": 1, "nextRunAt": "2026-12-01T01:00:00Z",
            "createdAt": "2026-11-01T00:00:00Z", "updatedAt": "2026-11-01T00:00:00Z", "lastRun": None,
            **extra}


def test_create_with_cron_sends_body_and_token(api: FakeApi) -> None:
    api.routes[("POST", "/jobs")] = (201, {"jobId": JOB_ID, "nextRunAt": "2026-12-01T01:00:00Z"})
    result = invoke(client.jobs, [
        "create", "--name", "nightly-report", "--cron", "0 2 * * *", "--timezone", "Europe/Berlin",
        "--url", "https://reports.internal/run", "--header", "X-Team: data", "--body", '{"full": true}',
        "--max-attempts", "5", "--timeout", "600", "--concurrency", "queue", "--priority", "high",
        "--idempotency-key", "abc-1",
    ], api)
    assert result.exit_code == 0, result.output
    [seen] = api.requests
    assert (seen.method, seen.path) == ("POST", "/jobs")
    assert seen.headers["authorization"] == f"Bearer {TOKEN}"
    assert seen.headers["idempotency-key"] == "abc-1"
    assert seen.body == {
        "name": "nightly-report",
        "schedule": {"cron": "0 2 * * *", "timezone": "Europe/Berlin"},
        "task": {"type": "http", "method": "POST", "url": "https://reports.internal/run",
                 "headers": {"X-Team": "data"}, "body": {"full": True}},
        "retryPolicy": {"maxAttempts": 5}, "timeoutSec": 600, "concurrency": "queue", "priority": "high",
    }
    assert JOB_ID in result.output
    assert "2026-12-01 01:00:00Z" in result.output


def test_create_command_task_splits_with_shlex(api: FakeApi) -> None:
    api.routes[("POST", "/jobs")] = (201, {"jobId": JOB_ID, "nextRunAt": "2026-12-01T09:00:00Z"})
    result = invoke(client.jobs, ["create", "--name", "once", "--at", "2026-12-01T09:00:00Z",
                                  "--command", "backup.sh --dest '/mnt/my disk'"], api)
    assert result.exit_code == 0, result.output
    assert api.requests[0].body == {
        "name": "once", "schedule": {"at": "2026-12-01T09:00:00Z"},
        "task": {"type": "command", "argv": ["backup.sh", "--dest", "/mnt/my disk"]},
    }
    assert "idempotency-key" not in api.requests[0].headers


@pytest.mark.parametrize("from_stdin", [False, True])
def test_create_from_file_posts_it_unchanged(api: FakeApi, tmp_path: Any, from_stdin: bool) -> None:
    api.routes[("POST", "/jobs")] = (201, {"jobId": JOB_ID, "nextRunAt": None})
    body = {"name": "from-file", "schedule": {"at": "2026-12-01T09:00:00+01:00"},
            "task": {"type": "container", "image": "alpine", "command": ["true"]}}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(body))
    args = ["create", "--file", "-" if from_stdin else str(path)]
    result = invoke(client.jobs, args, api, stdin=json.dumps(body) if from_stdin else None)
    assert result.exit_code == 0, result.output
    assert api.requests[0].body == body
    assert JOB_ID in result.output


def test_create_rejects_file_mixed_with_options_and_sends_nothing(api: FakeApi, tmp_path: Any) -> None:
    path = tmp_path / "job.json"
    path.write_text("{}")
    result = invoke(client.jobs, ["create", "--file", str(path), "--name", "x"], api)
    assert result.exit_code == 2
    assert "--file cannot be combined with --name" in result.output
    assert api.requests == []


def test_list_all_follows_cursors(api: FakeApi) -> None:
    pages = {None: ([job(1), job(2, paused=True)], "c2"),
             "c2": ([job(3, lastRun={"status": "failed"}, schedule={"at": "2026-12-24T18:00:00Z"})], None)}

    def page(seen: Seen) -> Answer:
        jobs, nxt = pages[seen.query.get("cursor", [None])[0]]
        return 200, {"jobs": jobs, "nextCursor": nxt}

    api.routes[("GET", "/jobs")] = page
    result = invoke(client.jobs, ["list", "--all", "--limit", "2"], api)
    assert result.exit_code == 0, result.output
    assert [r.query for r in api.requests] == [{"limit": ["2"]}, {"limit": ["2"], "cursor": ["c2"]}]
    for text in ("job-1", "job-2", "job-3", "0 2 * * * (Europe/Berlin)", "at 2026-12-24 18:00:00Z", "failed"):
        assert text in result.output


def test_list_without_all_reads_one_page_and_json_is_raw(api: FakeApi) -> None:
    api.routes[("GET", "/jobs")] = (200, {"jobs": [job(1)], "nextCursor": "c2"})
    result = invoke(client.jobs, ["list", "--json"], api)
    assert result.exit_code == 0, result.output
    assert len(api.requests) == 1
    assert json.loads(result.stdout) == {"jobs": [job(1)], "nextCursor": "c2"}


def test_create_with_semantics_options(api: FakeApi) -> None:
    api.routes[("POST", "/jobs")] = (201, {"jobId": JOB_ID, "nextRunAt": None})
    result = invoke(client.jobs, [
        "create", "--name", "n", "--cron", "*/5 * * * *", "--command", "true", "--catch-up", "none",
        "--tag", "db-heavy", "--tag", "nightly", "--notify-url", "https://alerts.internal/chimes",
    ], api)
    assert result.exit_code == 0, result.output
    body = api.requests[0].body
    assert body["catchUp"] == {"policy": "none"} and body["tags"] == ["db-heavy", "nightly"]
    assert body["notifyUrl"] == "https://alerts.internal/chimes"


def test_backfill_posts_the_range(api: FakeApi) -> None:
    api.routes[("POST", f"/jobs/{JOB_ID}/backfill")] = (202, {"runIds": [], "created": 3, "existing": 2})
    result = invoke(client.jobs, ["backfill", JOB_ID, "--start", "2026-11-01T00:00:00Z",
                                  "--end", "2026-11-01T05:00:00Z"], api)
    assert result.exit_code == 0, result.output
    assert api.requests[0].body == {"start": "2026-11-01T00:00:00Z", "end": "2026-11-01T05:00:00Z"}
    assert "created 3 runs; 2 slots already had one" in result.output


def test_pause_sends_patch(api: FakeApi) -> None:
    api.routes[("PATCH", f"/jobs/{JOB_ID}")] = (200, job(1, paused=True))
    result = invoke(client.jobs, ["pause", JOB_ID], api)
    assert result.exit_code == 0, result.output
    [seen] = api.requests
    assert (seen.method, seen.path, seen.body) == ("PATCH", f"/jobs/{JOB_ID}", {"paused": True})
    assert f"paused job {JOB_ID}" in result.output


def test_update_timezone_keeps_current_cron(api: FakeApi) -> None:
    api.routes[("GET", f"/jobs/{JOB_ID}")] = (200, job(1))
    api.routes[("PATCH", f"/jobs/{JOB_ID}")] = (200, job(1, version=2))
    result = invoke(client.jobs, ["update", JOB_ID, "--timezone", "Asia/Tokyo", "--name", "renamed"], api)
    assert result.exit_code == 0, result.output
    assert api.requests[-1].body == {"name": "renamed",
                                     "schedule": {"cron": "0 2 * * *", "timezone": "Asia/Tokyo"}}
    assert "version 2" in result.output


def test_api_error_prints_message_and_exits_1(api: FakeApi) -> None:
    api.routes[("POST", "/jobs")] = (422, {"error": "invalid_request", "field": "schedule.cron",
                                           "message": "schedule.cron: bad field 'x'"})
    result = invoke(client.jobs, ["create", "--name", "n", "--cron", "x", "--command", "true"], api)
    assert result.exit_code == 1
    assert "error: schedule.cron: bad field 'x'" in result.stderr
    assert result.stdout == ""


def test_not_found_from_get(api: FakeApi) -> None:
    result = invoke(client.runs, ["get", "nope"], api)
    assert result.exit_code == 1
    assert "error: /runs/nope not found" in result.stderr


def test_missing_token_is_a_usage_error(api: FakeApi) -> None:
    result = invoke(client.jobs, ["list"], api, token=None)
    assert result.exit_code == 2
    assert "pass --token or set CHIMES_TOKEN" in result.output
    assert api.requests == []


def test_connection_refused_says_what_to_start() -> None:
    with socket.socket() as sock:  # bound but not listening: connecting is refused
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        result = invoke(client.runs, ["get", RUN_ID], url=url)
    assert result.exit_code == 1
    assert f"cannot reach the Chimes API at {url}: is `chimes up` (or `chimes api`) running?" in result.stderr


def run_body(**extra: Any) -> dict[str, Any]:
    return {
        "runId": RUN_ID, "jobId": JOB_ID, "scheduledAt": "2026-12-01T01:00:00Z", "status": "succeeded",
        "attempt": 2, "trigger": "schedule", "startedAt": "2026-12-01T01:00:05Z",
        "finishedAt": "2026-12-01T01:00:09+00:00", "error": None,
        "attempts": [
            {"attempt": 1, "workerId": "worker-a", "startedAt": "2026-12-01T01:00:00Z",
             "finishedAt": "2026-12-01T01:00:01Z", "status": "failed", "error": "HTTP 503 [/oops]",
             "output": "boom"},
            {"attempt": 2, "workerId": "worker-b", "startedAt": "2026-12-01T02:00:05+01:00",
             "finishedAt": "2026-12-01T01:00:09Z", "status": "succeeded", "error": None,
             "output": "line one\nall done"},
        ], **extra,
    }


def test_runs_get_renders_attempts_and_output(api: FakeApi) -> None:
    api.routes[("GET", f"/runs/{RUN_ID}")] = (200, run_body())
    result = invoke(client.runs, ["get", RUN_ID], api)
    assert result.exit_code == 0, result.output
    out = result.output
    for text in ("worker-a", "worker-b", "HTTP 503 [/oops]", "2026-12-01 01:00:05Z", "all done"):
        assert text in out
    assert out.index("worker-a") < out.index("worker-b")
    assert "boom" not in out  # only the last attempt's output is shown


def test_runs_list_sends_filters(api: FakeApi) -> None:
    page = {"runs": [run_body(error="x" * 300)], "nextCursor": None}
    api.routes[("GET", f"/jobs/{JOB_ID}/runs")] = (200, page)
    result = invoke(client.runs, ["list", JOB_ID, "--status", "failed", "--limit", "5"], api)
    assert result.exit_code == 0, result.output
    assert api.requests[0].query == {"status": ["failed"], "limit": ["5"]}
    assert RUN_ID in result.output and "x" * 59 + "…" in result.output and "x" * 61 not in result.output


def test_rerun_and_cancel(api: FakeApi) -> None:
    api.routes[("POST", f"/runs/{RUN_ID}/rerun")] = (202, {"runId": "new-run"})
    api.routes[("POST", f"/runs/{RUN_ID}/cancel")] = (200, run_body(status="cancelled"))
    assert "started run new-run" in invoke(client.runs, ["rerun", RUN_ID], api).output
    assert f"run {RUN_ID}: cancelled" in invoke(client.runs, ["cancel", RUN_ID], api).output
    assert [(r.method, r.path) for r in api.requests] == [("POST", f"/runs/{RUN_ID}/rerun"),
                                                          ("POST", f"/runs/{RUN_ID}/cancel")]


def test_watch_refreshes_until_ctrl_c(api: FakeApi, monkeypatch: pytest.MonkeyPatch) -> None:
    api.routes[("GET", f"/jobs/{JOB_ID}/runs")] = (200, {"runs": [run_body()], "nextCursor": None})
    naps: list[float] = []

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(client, "_sleep", sleep)
    result = invoke(client.runs, ["watch", JOB_ID, "--interval", "0.5"], api)
    assert result.exit_code == 0, result.output
    assert naps == [0.5, 0.5]
    assert len(api.requests) == 2  # the first view, then one refresh before Ctrl-C
    assert RUN_ID in result.output


def test_watch_ends_the_request_ctrl_c_came_during_then_stops(api: FakeApi, monkeypatch: pytest.MonkeyPatch) -> None:
    def runs_then_ctrl_c(_seen: Seen) -> Answer:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the command waits for this answer
        return 200, {"runs": [run_body()], "nextCursor": None}

    def no_nap(seconds: float) -> None:
        pytest.fail("the watch slept on after Ctrl-C")

    api.routes[("GET", f"/jobs/{JOB_ID}/runs")] = runs_then_ctrl_c
    monkeypatch.setattr(client, "_sleep", no_nap)
    before = signal.getsignal(signal.SIGINT)  # ignored when the tests run in the background (nohup, &)
    result = invoke(client.runs, ["watch", JOB_ID, "--interval", "0.5"], api)
    assert result.exit_code == 0, result.output
    assert len(api.requests) == 1
    assert RUN_ID in result.output, "the request under way ended, and its runs were shown"
    assert signal.getsignal(signal.SIGINT) == before, "Ctrl-C is handled as before the watch again"


def test_watch_on_a_terminal_redraws_the_table_and_stops_when_done(
    api: FakeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    running, ended = run_body(status="running", finishedAt=None), run_body()
    answers = iter([running, ended])
    api.routes[("GET", f"/jobs/{JOB_ID}/runs")] = lambda _: (200, {"runs": [next(answers)], "nextCursor": None})
    monkeypatch.setattr(client, "_sleep", lambda seconds: None)
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich then takes the output for a terminal
    result = invoke(client.runs, ["watch", JOB_ID, "--until-done"], api)
    assert result.exit_code == 0, result.output
    assert len(api.requests) == 2, "the table again until every run ended, then it stops"
    assert f"runs of job {JOB_ID}" in result.output and "\x1b[" in result.output


@pytest.mark.parametrize(("value", "shown"), [
    ("2026-12-01T10:00:00+01:00", "2026-12-01 09:00:00Z"),
    ("2026-12-01T09:00:00.123Z", "2026-12-01 09:00:00Z"),
    (None, ""),
    ("not a time", "not a time"),
])
def test_times_are_shown_in_utc(value: str | None, shown: str) -> None:
    assert when(value) == shown


def test_a_rate_limited_request_is_sent_again_after_retry_after(api: FakeApi, monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    monkeypatch.setattr(client, "_sleep", waits.append)
    refused = {"error": "rate_limited", "message": "too many writes with this token; retry after 2 s", "field": None}
    answers = iter([(429, refused), (429, refused), (201, {"jobId": JOB_ID, "nextRunAt": None})])
    api.routes[("POST", "/jobs")] = lambda seen: next(answers)
    api.headers[("POST", "/jobs")] = {"Retry-After": "2"}
    result = invoke(client.jobs, ["create", "--name", "n", "--cron", "@daily", "--url", "https://x.test/"], api)
    assert result.exit_code == 0, result.output
    assert waits == [2.0, 2.0] and len(api.requests) == 3
    assert "retry" not in result.output  # waiting is not news: only the answer is printed


def test_rate_limit_retries_are_bounded_and_a_quota_is_not_retried(
    api: FakeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    waits: list[float] = []
    monkeypatch.setattr(client, "_sleep", waits.append)
    api.routes[("POST", "/jobs")] = (429, {"error": "rate_limited", "message": "slow down", "field": None})
    api.headers[("POST", "/jobs")] = {"Retry-After": "3600"}
    args = ["create", "--name", "n", "--cron", "@daily", "--url", "https://x.test/"]
    result = invoke(client.jobs, args, api)
    assert result.exit_code == 1 and "slow down" in result.output
    assert waits == [client.RETRY_AFTER_CAP_SEC] * client.RATE_LIMIT_RETRIES
    api.requests.clear()
    api.headers.clear()  # a full job quota: 429 without Retry-After
    api.routes[("POST", "/jobs")] = (429, {"error": "job_quota_exceeded", "message": "quota", "field": None})
    assert invoke(client.jobs, args, api).exit_code == 1 and len(api.requests) == 1


@pytest.mark.parametrize(("offset", "shown"), [(0, "now"), (90, "in 1m"), (-7200, "2h ago"), (-3 * 86400, "3d ago")])
def test_relative_times(offset: int, shown: str) -> None:
    now = datetime(2026, 12, 1, 9, tzinfo=UTC)
    assert relative((now + timedelta(seconds=offset)).isoformat(), now) == shown


def test_a_short_job_id_names_the_one_job_whose_id_ends_with_it(api: FakeApi) -> None:
    ids = ["0190aaaa-0000-7000-8000-00000000beef", "0190aaaa-0000-7000-8000-00001234beef"]
    api.routes[("GET", "/jobs")] = (200, {"jobs": [job(1, jobId=i) for i in ids], "nextCursor": None})
    api.routes[("GET", f"/jobs/{ids[1]}")] = (200, job(2, jobId=ids[1]))
    shown = invoke(client.jobs, ["get", "1234beef", "-o", "json"], api)
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["jobId"] == ids[1]
    ambiguous = invoke(client.jobs, ["get", "beef"], api)
    assert ambiguous.exit_code == 1 and "2 jobs have an id ending in beef" in ambiguous.output


def test_the_bound_options_are_the_bounds_of_every_recurring_schedule() -> None:
    from chimes.jobs import _RecurringScheduleSpec

    fields = _RecurringScheduleSpec.model_fields
    assert client.BOUND_OPTIONS == {name: field.alias for name, field in fields.items()}
