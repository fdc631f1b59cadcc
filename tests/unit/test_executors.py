"""Executors against a real local HTTP server and real /bin/sh subprocesses (no database)."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from chimes.worker.tasks.command import BASE_ENV, CommandExecutor
from chimes.worker.tasks.common import OUTPUT_TAIL_BYTES, Outcome, OutputTail, TaskContext, rfc3339_utc
from chimes.worker.tasks.dispatch import Executors
from chimes.worker.tasks.http import USER_AGENT, HttpExecutor
from tests.helpers import wait_for

SCHEDULED = datetime(2026, 12, 1, 9, 0, 0, tzinfo=UTC)
DEADLINE_SEC = 10.0


def make_ctx(timeout_sec: float = 10.0, **overrides: Any) -> TaskContext:
    values: dict[str, Any] = {
        "run_id": "run-123",
        "job_id": "job-abc",
        "attempt": 2,
        "scheduled_at": SCHEDULED,
        "timeout_sec": timeout_sec,
    }
    values.update(overrides)
    return TaskContext(**values)


async def wait_until(predicate: Callable[[], bool], what: str, within: float = DEADLINE_SEC) -> None:
    """Poll ``predicate`` until true or fail after ``within`` seconds (no fixed sleeps)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not predicate():
        if loop.time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


# Start times of the processes the tests read pids of: a pid reused by a newer process (other tests
# on a busy machine start many) must not count as the old process still running.
_started: dict[int, str] = {}


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()[19]


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is the process first seen with it; zombies count as dead (the
    container init may never reap them)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    if pid in _started and _start_time(pid) != _started[pid]:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def pid_in(path: Path) -> int | None:
    """The pid written to ``path`` by a test script, or None while it is not written yet."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        return None
    pid = int(text)
    started = _start_time(pid)
    if started is not None:
        _started.setdefault(pid, started)
    return pid


def same_dir(a: str, b: Path) -> bool:
    return Path(a).resolve() == b.resolve()


async def read_pid(path: Path) -> int:
    await wait_until(lambda: pid_in(path) is not None, f"pid file {path}")
    pid = pid_in(path)
    assert pid is not None
    return pid


# --------------------------------------------------------------------------- helpers


def test_rfc3339_utc_formats() -> None:
    assert rfc3339_utc(SCHEDULED) == "2026-12-01T09:00:00Z"
    assert rfc3339_utc(SCHEDULED.replace(microsecond=123456)) == "2026-12-01T09:00:00.123Z"
    plus_two = datetime(2026, 12, 1, 11, 0, tzinfo=timezone(timedelta(hours=2)))
    assert rfc3339_utc(plus_two) == "2026-12-01T09:00:00Z"


def test_output_tail_keeps_end_and_drops_split_characters() -> None:
    tail = OutputTail(8)
    tail.feed(b"x" * 100)
    tail.feed("é".encode() * 20 + b"END")
    text = tail.text()
    assert text is not None
    assert text == "ééééé" + "END"
    assert "\ufffd" not in text
    assert tail.total_bytes == 100 + 40 + 3
    assert OutputTail().text() is None


# --------------------------------------------------------------------------- HTTP


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Server:
    base: str
    requests: list[Recorded] = field(default_factory=list)


@asynccontextmanager
async def serving() -> AsyncIterator[Server]:
    release = asyncio.Event()
    srv = Server(base="")

    async def record(request: web.Request) -> None:
        srv.requests.append(
            Recorded(request.method, request.path, dict(request.headers), await request.read())
        )

    async def ok(request: web.Request) -> web.Response:
        await record(request)
        return web.Response(status=201, text="created")

    async def status(request: web.Request) -> web.Response:
        await record(request)
        return web.Response(status=int(request.match_info["code"]), text="service unavailable")

    async def hang(request: web.Request) -> web.Response:
        await record(request)
        await release.wait()
        return web.Response(text="too late")

    async def big(request: web.Request) -> web.Response:
        await record(request)
        return web.Response(body=b"a" * 20_000 + b"THE-END")

    async def redirect(request: web.Request) -> web.Response:
        await record(request)
        return web.Response(status=int(request.match_info["code"]), headers={"Location": request.query["to"]})

    app = web.Application()
    async def loop(request: web.Request) -> web.Response:
        await record(request)
        return web.Response(status=302, headers={"Location": "/loop"})

    app.router.add_route("*", "/redirect/{code}", redirect)
    app.router.add_get("/loop", loop)
    app.router.add_route("*", "/ok", ok)
    app.router.add_route("*", "/status/{code}", status)
    app.router.add_get("/hang", hang)
    app.router.add_get("/big", big)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    srv.base = f"http://127.0.0.1:{port}"
    try:
        yield srv
    finally:
        release.set()
        await runner.cleanup()


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    async with serving() as srv:
        yield srv


@pytest.fixture
async def elsewhere() -> AsyncIterator[Server]:
    """A second server: another origin (same host, another port)."""
    async with serving() as srv:
        yield srv


async def test_http_sends_identity_headers_and_json_body(server: Server, http: HttpExecutor) -> None:
    task = {
        "type": "http",
        "method": "post",
        "url": f"{server.base}/ok",
        "headers": {"X-Custom": "yes", "idempotency-key": "forged", "X-Chimes-Run-Id": "forged"},
        "body": {"hello": "world", "n": [1, 2]},
    }
    outcome = await http.run(task, make_ctx(scheduled_at=SCHEDULED.replace(microsecond=5000)))
    assert outcome == Outcome.success("created")
    [req] = server.requests
    assert req.method == "POST"
    assert req.headers["Idempotency-Key"] == "run-123"
    assert req.headers["X-Chimes-Run-Id"] == "run-123"
    assert req.headers["X-Chimes-Job-Id"] == "job-abc"
    assert req.headers["X-Chimes-Attempt"] == "2"
    assert req.headers["X-Chimes-Scheduled-At"] == "2026-12-01T09:00:00.005Z"
    assert req.headers["User-Agent"] == USER_AGENT
    assert USER_AGENT.startswith("chimes/")
    assert req.headers["X-Custom"] == "yes"
    assert req.headers["Content-Type"] == "application/json"
    assert orjson.loads(req.body) == {"hello": "world", "n": [1, 2]}


async def test_http_string_body_sent_as_is_and_defaults_to_get(server: Server, http: HttpExecutor) -> None:
    plain = await http.run(
        {"type": "http", "method": "PUT", "url": f"{server.base}/ok", "body": "raw {x}"}, make_ctx()
    )
    custom = await http.run(
        {
            "type": "http",
            "method": "POST",
            "url": f"{server.base}/ok",
            "headers": {"content-type": "application/xml", "User-Agent": "mine/1"},
            "body": "<a/>",
        },
        make_ctx(),
    )
    no_body = await http.run({"type": "http", "url": f"{server.base}/ok"}, make_ctx())
    assert plain.succeeded and custom.succeeded and no_body.succeeded
    first, second, third = server.requests
    assert (first.method, first.body) == ("PUT", b"raw {x}")
    assert first.headers["Content-Type"].startswith("text/plain")
    assert (second.body, second.headers["Content-Type"]) == (b"<a/>", "application/xml")
    assert second.headers["User-Agent"] == "mine/1"
    assert (third.method, third.body) == ("GET", b"")
    assert "Content-Type" not in third.headers


SECRET_TASK_HEADERS = {"Authorization": "Bearer s3cret", "X-Api-Key": "k3y"}


async def test_http_redirect_within_the_origin_keeps_headers_and_body(server: Server, http: HttpExecutor) -> None:
    task = {"type": "http", "method": "POST", "url": f"{server.base}/redirect/307?to=/ok",
            "headers": SECRET_TASK_HEADERS, "body": {"n": 1}}
    outcome = await http.run(task, make_ctx(signing_secret="whsec_test"))
    assert outcome == Outcome.success("created")
    first, landed = server.requests
    assert (landed.method, landed.path, landed.body) == ("POST", "/ok", first.body)
    for name in [*SECRET_TASK_HEADERS, "X-Chimes-Signature", "Idempotency-Key"]:
        assert landed.headers[name] == first.headers[name]


async def test_http_redirect_to_another_origin_drops_task_headers_and_signature(
    server: Server, elsewhere: Server, http: HttpExecutor
) -> None:
    task = {"type": "http", "method": "POST", "url": f"{server.base}/redirect/308?to={elsewhere.base}/ok",
            "headers": SECRET_TASK_HEADERS, "body": {"n": 1}}
    outcome = await http.run(task, make_ctx(signing_secret="whsec_test"))
    assert outcome == Outcome.success("created")
    [first] = server.requests
    [landed] = elsewhere.requests
    assert all(first.headers[name] for name in [*SECRET_TASK_HEADERS, "X-Chimes-Signature"])
    assert not {*SECRET_TASK_HEADERS, "X-Chimes-Signature"} & set(landed.headers)
    assert landed.headers["Idempotency-Key"] == "run-123" and landed.headers["User-Agent"] == USER_AGENT
    assert (landed.method, landed.body, landed.headers["Content-Type"]) == ("POST", first.body, "application/json")


async def test_http_303_turns_into_a_get_without_body(server: Server, http: HttpExecutor) -> None:
    task = {"type": "http", "method": "POST", "url": f"{server.base}/redirect/303?to=/ok", "body": {"n": 1}}
    assert (await http.run(task, make_ctx())).succeeded
    _, landed = server.requests
    assert (landed.method, landed.body) == ("GET", b"") and "Content-Type" not in landed.headers


async def test_http_redirect_loop_and_unsupported_scheme_fail_clearly(server: Server, http: HttpExecutor) -> None:
    loop = await http.run({"type": "http", "url": f"{server.base}/loop"}, make_ctx())
    assert loop == Outcome.failure("more than 10 redirects")
    assert len(server.requests) == 11
    odd = await http.run({"type": "http", "url": f"{server.base}/redirect/302?to=file:///etc/passwd"}, make_ctx())
    assert odd == Outcome.failure("HTTP 302: redirect to an unsupported URL file:///etc/passwd")


async def test_http_non_2xx_is_failure(server: Server, http: HttpExecutor) -> None:
    task = {"type": "http", "method": "GET", "url": f"{server.base}/status/503"}
    outcome = await http.run(task, make_ctx())
    assert outcome == Outcome.failure("HTTP 503", "service unavailable")
    not_found = await http.run({"type": "http", "url": f"{server.base}/status/404"}, make_ctx())
    assert not_found.error == "HTTP 404"


async def test_http_timeout(server: Server, http: HttpExecutor) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    outcome = await http.run({"type": "http", "url": f"{server.base}/hang"}, make_ctx(timeout_sec=0.5))
    elapsed = loop.time() - started
    assert outcome.succeeded is False
    assert outcome.error == "timed out after 0.5s"
    assert 0.4 <= elapsed < 5.0
    assert len(server.requests) == 1


@pytest.mark.parametrize("first_sec, second_sec", [(3.0, 0.3), (0.3, 3.0)])
async def test_http_timeouts_of_calls_in_flight_together_each_end_their_own_call(
        server: Server, http: HttpExecutor, first_sec: float, second_sec: float) -> None:
    """Each call has a timer of its own: a later one must not delay an earlier one (the short call
    started second ends long before the long call's time), and an earlier one that fires first must
    leave the longer call its own (a timer lost leaves that call hanging)."""
    loop = asyncio.get_running_loop()

    async def hanging_call(timeout_sec: float) -> tuple[Outcome, float]:
        started = loop.time()
        outcome = await http.run({"type": "http", "url": f"{server.base}/hang"}, make_ctx(timeout_sec=timeout_sec))
        return outcome, loop.time() - started

    first = asyncio.ensure_future(hanging_call(first_sec))
    await wait_for(lambda: len(server.requests) == 1, timeout=5.0, what="the first call to arrive")
    second = asyncio.ensure_future(hanging_call(second_sec))
    for call, timeout_sec in ((first, first_sec), (second, second_sec)):
        outcome, elapsed = await asyncio.wait_for(call, timeout=10)
        assert outcome.error == f"timed out after {timeout_sec:g}s"
        assert timeout_sec - 0.1 <= elapsed < timeout_sec + 2.0


async def test_http_connection_refused(http: HttpExecutor) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    outcome = await http.run({"type": "http", "url": f"http://127.0.0.1:{port}/"}, make_ctx(timeout_sec=5))
    assert outcome.succeeded is False
    assert outcome.error is not None
    assert outcome.error.startswith(f"connection refused: Failed to connect to 127.0.0.1:{port}")


async def test_http_invalid_request_is_failed_outcome(http: HttpExecutor) -> None:
    outcome = await http.run({"type": "http", "url": "not a url"}, make_ctx())
    assert outcome.succeeded is False
    assert outcome.error


async def test_http_large_body_output_capped_keeps_end(server: Server, http: HttpExecutor) -> None:
    outcome = await http.run({"type": "http", "url": f"{server.base}/big"}, make_ctx())
    assert outcome.succeeded
    assert outcome.output is not None
    assert len(outcome.output) == OUTPUT_TAIL_BYTES
    assert outcome.output.endswith("aaaTHE-END")


async def test_http_cancellation_propagates(server: Server, http: HttpExecutor) -> None:
    task = asyncio.create_task(http.run({"type": "http", "url": f"{server.base}/hang"}, make_ctx()))
    await wait_until(lambda: len(server.requests) == 1, "request to reach the server")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_http_session_is_pooled_and_reopened_after_close(server: Server, http: HttpExecutor) -> None:
    await http.run({"type": "http", "url": f"{server.base}/ok"}, make_ctx(owner="team-a"))
    first = http.pool_of("team-a")
    await http.run({"type": "http", "url": f"{server.base}/ok"}, make_ctx(owner="team-a"))
    assert first is not None and http.pool_of("team-a") is first
    await http.close()
    assert first.closed
    again = await http.run({"type": "http", "url": f"{server.base}/ok"}, make_ctx(owner="team-a"))
    assert again.succeeded and http.pool_of("team-a") not in (None, first)


async def test_http_owners_never_share_a_pool_and_idle_pools_close(server: Server) -> None:
    http = HttpExecutor(max_connections=10, max_owner_pools=2, owner_pool_idle_sec=3600)
    try:
        for owner in ("team-a", "team-b"):
            assert (await http.run({"type": "http", "url": f"{server.base}/ok"}, make_ctx(owner=owner))).succeeded
        a, b = http.pool_of("team-a"), http.pool_of("team-b")
        assert a is not None and b is not None and a is not b
        await http.run({"type": "http", "url": f"{server.base}/ok"}, make_ctx(owner="team-c"))
        await http.run({"type": "http", "url": f"{server.base}/ok"}, make_ctx(owner="team-c"))
        assert a.closed and http.pool_of("team-a") is None, "beyond the bound, the least recently used closes"
        assert http.pool_of("team-b") is b and not b.closed
    finally:
        await http.close()
    idle = HttpExecutor(owner_pool_idle_sec=0.0)
    try:
        await idle.run({"type": "http", "url": f"{server.base}/ok"}, make_ctx(owner="team-a"))
        first = idle.pool_of("team-a")
        await idle.run({"type": "http", "url": f"{server.base}/ok"}, make_ctx(owner="team-b"))
        assert first is not None and first.closed, "an idle pool is closed"
    finally:
        await idle.close()


async def test_http_pool_in_flight_during_a_sweep_is_closed_once_idle(server: Server) -> None:
    idle = HttpExecutor(owner_pool_idle_sec=0.0)
    try:
        hanging = asyncio.ensure_future(idle.run({"type": "http", "url": f"{server.base}/hang"},
                                                 make_ctx(timeout_sec=0.5, owner="team-a")))
        await wait_for(lambda: len(server.requests) == 1, timeout=5.0, what="the hanging call to arrive")
        busy = idle.pool_of("team-a")
        for _ in range(2):  # pools are gone through meanwhile: team-a's, in flight, stays open
            assert (await idle.run({"type": "http", "url": f"{server.base}/ok"}, make_ctx(owner="team-b"))).succeeded
        assert busy is not None and not busy.closed
        assert (await hanging).error == "timed out after 0.5s"
        await idle.run({"type": "http", "url": f"{server.base}/ok"}, make_ctx(owner="team-b"))
        assert busy.closed and idle.pool_of("team-a") is None, "idle once its call ended, it is closed"
    finally:
        await idle.close()


async def test_http_lease_token_only_for_callback_tasks_on_their_origin(
    server: Server, elsewhere: Server, http: HttpExecutor
) -> None:
    ctx = make_ctx(lease_token="lease-secret")
    await http.run({"type": "http", "url": f"{server.base}/ok"}, ctx)
    await http.run({"type": "http", "url": f"{server.base}/ok", "callback": True}, ctx)
    await http.run({"type": "http", "url": f"{server.base}/redirect/307?to={elsewhere.base}/ok", "callback": True},
                   ctx)
    plain, callback, redirected = server.requests
    assert "X-Chimes-Lease-Token" not in plain.headers
    assert callback.headers["X-Chimes-Lease-Token"] == "lease-secret"
    assert redirected.headers["X-Chimes-Lease-Token"] == "lease-secret"
    [landed] = elsewhere.requests
    assert "X-Chimes-Lease-Token" not in landed.headers, "never to another origin"


async def test_http_framing_headers_of_a_stored_task_are_dropped(server: Server, http: HttpExecutor) -> None:
    """Rows written around the API (before the rule, or by hand) must not set the framing either."""
    task = {"type": "http", "method": "POST", "url": f"{server.base}/ok", "body": "0\r\n\r\nGET /x HTTP/1.1\r\n",
            "headers": {"Transfer-Encoding": "chunked", "Connection": "keep-alive", "Host": "evil.example",
                        "Proxy-Authorization": "Basic eA==", "Expect": "100-continue", "X-Kept": "yes"}}
    outcome = await http.run(task, make_ctx())
    assert outcome.succeeded, outcome
    [req] = server.requests
    assert req.headers["Host"] == server.base.removeprefix("http://")
    assert req.headers["X-Kept"] == "yes"
    assert "Transfer-Encoding" not in req.headers and "Proxy-Authorization" not in req.headers
    assert "Expect" not in req.headers
    assert req.body == b"0\r\n\r\nGET /x HTTP/1.1\r\n"


async def test_http_a_control_character_in_a_stored_header_fails_clearly(server: Server, http: HttpExecutor) -> None:
    task = {"type": "http", "url": f"{server.base}/ok", "headers": {"X-Odd": "a\x0bb"}}
    outcome = await http.run(task, make_ctx())
    assert outcome == Outcome.failure("header 'X-Odd' contains the control character '\\x0b'")
    assert server.requests == []


# --------------------------------------------------------------------------- commands


def sh(script: str, **extra: Any) -> dict[str, Any]:
    return {"type": "command", "argv": ["/bin/sh", "-c", script], **extra}


async def test_command_success_with_merged_output() -> None:
    outcome = await CommandExecutor().run(sh("echo out; echo err >&2"), make_ctx())
    assert outcome == Outcome.success("out\nerr\n")


async def test_command_exit_code_and_signal() -> None:
    failed = await CommandExecutor().run(sh("echo partial; exit 3"), make_ctx())
    assert failed == Outcome.failure("exit code 3", "partial\n")
    killed = await CommandExecutor().run(sh("kill -TERM $$"), make_ctx())
    assert killed.error == "killed by signal SIGTERM"


async def test_command_env_and_cwd(tmp_path: Path) -> None:
    script = (
        'printf "%s|%s|%s|%s|%s|%s" "$CHIMES_RUN_ID" "$CHIMES_JOB_ID" "$CHIMES_ATTEMPT" '
        '"$CHIMES_SCHEDULED_AT" "$FOO" "$PATH"; echo; pwd'
    )
    task = sh(script, env={"FOO": "bar", "CHIMES_RUN_ID": "forged"}, cwd=str(tmp_path))
    outcome = await CommandExecutor().run(task, make_ctx())
    assert outcome.succeeded, outcome
    assert outcome.output is not None
    first, second = outcome.output.splitlines()
    assert first == f"run-123|job-abc|2|2026-12-01T09:00:00Z|bar|{os.environ['PATH']}"
    assert same_dir(second, tmp_path), second


async def test_command_gets_a_minimal_environment_not_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's secret key and database URL must not reach a team's program (a real subprocess)."""
    monkeypatch.setenv("CHIMES_SECRET_KEY", "worker-secret-key")
    monkeypatch.setenv("CHIMES_DATABASE_URL", "postgresql://chimes:db-password@db/chimes")
    monkeypatch.setenv("PGPASSWORD", "db-password")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "cloud-secret")
    monkeypatch.setenv("LC_TIME", "C")
    monkeypatch.setenv("HOME", "/home/worker")
    task = {"type": "command", "argv": ["env"], "env": {"FOO": "bar"}}
    outcome = await CommandExecutor().run(task, make_ctx())
    assert outcome.succeeded and outcome.output is not None, outcome
    env = dict(line.split("=", 1) for line in outcome.output.splitlines() if "=" in line)
    for leaked in ("worker-secret-key", "db-password", "cloud-secret"):
        assert leaked not in outcome.output
    assert env["FOO"] == "bar" and env["CHIMES_RUN_ID"] == "run-123" and env["PATH"] == os.environ["PATH"]
    assert env["HOME"] == "/home/worker" and env["LC_TIME"] == "C"
    assert set(env) <= {*BASE_ENV, "FOO", "CHIMES_RUN_ID", "CHIMES_JOB_ID", "CHIMES_ATTEMPT", "CHIMES_SCHEDULED_AT",
                        *(name for name in env if name.startswith("LC_"))}, sorted(env)


async def test_command_timeout_kills_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    loop = asyncio.get_running_loop()
    started = loop.time()
    outcome = await CommandExecutor(kill_grace_sec=5.0).run(
        sh(f"echo started; sleep 30 & echo $! > {pidfile}; wait"), make_ctx(timeout_sec=1.0)
    )
    assert outcome == Outcome.failure("timed out after 1s", "started\n")
    assert loop.time() - started < 5.0  # SIGTERM sufficed, no need to wait out the grace
    child = await read_pid(pidfile)
    await wait_until(lambda: not pid_alive(child), f"background child {child} to die")


async def test_command_timeout_escalates_to_sigkill(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    loop = asyncio.get_running_loop()
    started = loop.time()
    # SIG_IGN is inherited, so both the shell and its child ignore SIGTERM; only SIGKILL ends them.
    outcome = await CommandExecutor(kill_grace_sec=0.5).run(
        sh(f"trap '' TERM; sleep 30 & echo $! > {pidfile}; wait"), make_ctx(timeout_sec=0.5)
    )
    elapsed = loop.time() - started
    assert outcome.error == "timed out after 0.5s"
    assert 1.0 <= elapsed < 5.0
    child = await read_pid(pidfile)
    await wait_until(lambda: not pid_alive(child), f"TERM-ignoring child {child} to be killed")


async def test_command_output_tail_is_capped() -> None:
    outcome = await CommandExecutor().run(sh("yes abcdefghi | head -c 100000; printf THE-END"), make_ctx())
    assert outcome.succeeded, outcome.error
    assert outcome.output is not None
    assert len(outcome.output) == OUTPUT_TAIL_BYTES
    assert outcome.output.endswith("THE-END")


async def test_command_cancellation_kills_process_group(tmp_path: Path) -> None:
    shell_pidfile, child_pidfile = tmp_path / "sh.pid", tmp_path / "child.pid"
    script = f"echo $$ > {shell_pidfile}; sleep 30 & echo $! > {child_pidfile}; wait"
    task = asyncio.create_task(CommandExecutor().run(sh(script), make_ctx(timeout_sec=60)))
    shell, child = await read_pid(shell_pidfile), await read_pid(child_pidfile)
    assert pid_alive(shell) and pid_alive(child)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # Signalled before the task ended; on a loaded machine the kernel may take a moment to finish them.
    await wait_until(lambda: not pid_alive(shell), f"shell {shell} to die", within=30)
    await wait_until(lambda: not pid_alive(child), f"background child {child} to die", within=30)


async def test_command_missing_executable_and_cwd(tmp_path: Path) -> None:
    executor = CommandExecutor()
    missing = await executor.run({"type": "command", "argv": ["/nonexistent/chimes-nope"]}, make_ctx())
    assert missing == Outcome.failure("command not found: /nonexistent/chimes-nope")
    on_path = await executor.run({"type": "command", "argv": ["chimes-definitely-not-on-path"]}, make_ctx())
    assert on_path.error == "command not found: chimes-definitely-not-on-path"
    bad_cwd = await executor.run(sh("true", cwd=str(tmp_path / "gone")), make_ctx())
    assert bad_cwd.succeeded is False
    assert bad_cwd.error == f"working directory not found: {tmp_path / 'gone'}"


# --------------------------------------------------------------------------- dispatcher


async def test_executors_dispatch(server: Server) -> None:
    executors = Executors(max_connections=5, kill_grace_sec=1.0)
    try:
        runs: list[Awaitable[Outcome]] = [
            executors.run({"type": "http", "url": f"{server.base}/ok"}, make_ctx()),
            executors.run(sh("echo hi"), make_ctx()),
            executors.run({"type": "ftp"}, make_ctx()),
        ]
        http_outcome, command_outcome, unsupported = await asyncio.gather(*runs)
    finally:
        await executors.close()
    assert http_outcome == Outcome.success("created")
    assert command_outcome == Outcome.success("hi\n")
    assert unsupported == Outcome.failure("unsupported task type 'ftp'")
    assert len(server.requests) == 1


def test_task_modules_import_each_other_one_way_only() -> None:
    """The task modules form no import cycle and re-export nothing lazily: each can be imported
    alone, in any order, because every arrow between them points the same way."""
    import ast

    import chimes.worker.tasks as package

    folder = Path(package.__file__).parent
    prefix = "chimes.worker.tasks."
    graph: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        assert not any(isinstance(node, ast.FunctionDef) and node.name == "__getattr__" for node in tree.body), path
        graph[path.stem] = {node.module.removeprefix(prefix) for node in ast.walk(tree)
                            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(prefix)}
    assert {"common", "processes", "http", "command", "container", "dispatch"} <= graph.keys()
    assert graph["common"] == set()
    order: list[str] = []
    while len(order) < len(graph):  # peel off the modules whose imports are all placed already
        ready = sorted(name for name, needs in graph.items() if name not in order and needs <= set(order))
        assert ready, f"import cycle among {sorted(set(graph) - set(order))}"
        order += ready
