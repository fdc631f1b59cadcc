"""The dashboard over real HTTP: sign-in, CSRF, ownership, search, filters, paging and every page."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from html import unescape

import asyncpg
import httpx
import pytest

from chimes import __version__
from chimes.dashboard import pages
from chimes.store.owners import OwnerStore
from chimes.store.queries import sql
from chimes.store.tokens import create_token
from tests.helpers import wait_for
from tests.integration.fleet import Fleet
from tests.target import Target

CSRF = re.compile(r'name="csrf" value="([0-9a-f]+)"')


@contextlib.asynccontextmanager
async def signed_in(api_url: str, token: str) -> AsyncIterator[httpx.AsyncClient]:
    """A browser-like client holding the dashboard's session cookie."""
    async with httpx.AsyncClient(base_url=api_url, timeout=30) as browser:
        response = await browser.post("/ui/login", data={"token": token, "next": "/ui/jobs"})
        assert response.status_code == 303, response.text
        yield browser


@pytest.fixture
async def team_a(api_url: str, tokens: dict[str, str]) -> AsyncIterator[httpx.AsyncClient]:
    async with signed_in(api_url, tokens["team-a"]) as browser:
        yield browser


def csrf_of(html: str) -> str:
    found = CSRF.search(html)
    assert found, "no CSRF token in the page"
    return found.group(1)


def job_body(name: str, url: str = "http://127.0.0.1:9/", **extra: object) -> dict:
    return {"name": name, "schedule": {"cron": "0 3 * * *", "timezone": "Europe/Berlin"},
            "task": {"type": "http", "method": "POST", "url": url}, **extra}


async def create_job(client: httpx.AsyncClient, body: dict, token: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {token}"} if token else None
    response = await client.post("/jobs", json=body, headers=headers)
    assert response.status_code == 201, response.text
    return response.json()["jobId"]


async def test_pages_need_a_sign_in_and_the_cookie_is_http_only_and_strict(
    api_url: str, tokens: dict[str, str],
) -> None:
    async with httpx.AsyncClient(base_url=api_url, timeout=30) as browser:
        root = await browser.get("/")
        assert root.status_code == 303 and root.headers["location"] == "/ui/jobs"
        page = await browser.get("/ui/jobs?show=paused")
        assert page.status_code == 303
        assert page.headers["location"] == "/ui/login?next=/ui/jobs%3Fshow%3Dpaused"
        form = await browser.get(page.headers["location"])
        assert form.status_code == 200 and 'name="token"' in form.text

        wrong = await browser.post("/ui/login", data={"token": "chm_not-a-real-token", "next": "/ui/jobs"})
        assert wrong.status_code == 401 and "not valid" in wrong.text
        assert "set-cookie" not in wrong.headers

        ok = await browser.post("/ui/login", data={"token": tokens["team-a"], "next": "https://evil.example/"})
        assert ok.status_code == 303 and ok.headers["location"] == "/ui/jobs"  # never off-site
        cookie = ok.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/" in cookie
        assert "secure" not in cookie  # plain http here; https gets Secure

        jobs = await browser.get("/ui/jobs")
        assert jobs.status_code == 200 and "team-a" in jobs.text
        assert "script-src 'self'" in jobs.headers["content-security-policy"]

        signed_out = await browser.post("/ui/logout", data={"csrf": csrf_of(jobs.text)})
        assert signed_out.status_code == 303
        assert (await browser.get("/ui/jobs")).status_code == 303


async def test_a_revoked_token_ends_the_session(api_url: str, pool: asyncpg.Pool, tokens: dict[str, str]) -> None:
    async with signed_in(api_url, tokens["team-b"]) as browser:
        assert (await browser.get("/ui/jobs")).status_code == 200
        await pool.execute("UPDATE api_tokens SET revoked_at = now() WHERE owner = 'team-b'")
        assert (await browser.get("/ui/jobs")).status_code == 303
        refresh = await browser.get("/ui/jobs?fragment=table", headers={"HX-Request": "true"})
        assert refresh.status_code == 401 and refresh.headers["hx-redirect"].startswith("/ui/login")


async def test_actions_without_the_csrf_token_or_from_another_site_change_nothing(
    client: httpx.AsyncClient, team_a: httpx.AsyncClient,
) -> None:
    job_id = await create_job(client, job_body("nightly"))
    page = await team_a.get(f"/ui/jobs/{job_id}")
    token = csrf_of(page.text)

    missing = await team_a.post(f"/ui/jobs/{job_id}/pause", data={})
    assert missing.status_code == 403 and "did not go through" in missing.text
    forged = await team_a.post(f"/ui/jobs/{job_id}/pause", data={"csrf": "0" * 64})
    assert forged.status_code == 403
    cross_site = await team_a.post(f"/ui/jobs/{job_id}/run", data={"csrf": token},
                                   headers={"Origin": "https://evil.example"})
    assert cross_site.status_code == 403
    job = (await client.get(f"/jobs/{job_id}")).json()
    assert job["paused"] is False and job["lastRun"] is None

    paused = await team_a.post(f"/ui/jobs/{job_id}/pause", data={"csrf": token})
    assert paused.status_code == 303 and paused.headers["location"] == f"/ui/jobs/{job_id}?notice=paused"
    assert (await client.get(f"/jobs/{job_id}")).json()["paused"] is True
    resumed = await team_a.post(f"/ui/jobs/{job_id}/resume", data={"csrf": token})
    assert resumed.status_code == 303
    assert (await client.get(f"/jobs/{job_id}")).json()["paused"] is False


async def test_a_read_only_token_sees_pages_but_no_buttons_and_changes_nothing(
    api_url: str, pool: asyncpg.Pool, client: httpx.AsyncClient,
) -> None:
    job_id = await create_job(client, job_body("watched"))
    async with pool.acquire() as conn:
        reader = await create_token(conn, "team-a", scope="read")
    async with signed_in(api_url, reader) as browser:
        page = await browser.get(f"/ui/jobs/{job_id}")
        assert page.status_code == 200 and "watched" in page.text and "read-only" in page.text
        assert "Run now" not in page.text and "Pause" not in page.text
        refused = await browser.post(f"/ui/jobs/{job_id}/run", data={"csrf": csrf_of(page.text)})
        assert refused.status_code == 403 and "read-only" in refused.text
    assert (await client.get(f"/jobs/{job_id}/runs")).json()["runs"] == []


async def test_a_team_sees_only_its_own_jobs_and_an_admin_sees_all(
    api_url: str, client: httpx.AsyncClient, tokens: dict[str, str], team_a: httpx.AsyncClient,
) -> None:
    mine = await create_job(client, job_body("alpha-report"))
    theirs = await create_job(client, job_body("beta-cleanup"), token=tokens["team-b"])

    listing = (await team_a.get("/ui/jobs")).text
    assert "alpha-report" in listing and "beta-cleanup" not in listing
    assert (await team_a.get(f"/ui/jobs/{theirs}")).status_code == 404
    token = csrf_of(listing)
    assert (await team_a.post(f"/ui/jobs/{theirs}/run", data={"csrf": token})).status_code == 404
    assert (await client.get(f"/jobs/{theirs}/runs", headers={"Authorization": f"Bearer {tokens['team-b']}"})
            ).json()["runs"] == []

    async with signed_in(api_url, tokens["admin"]) as admin:
        everything = (await admin.get("/ui/jobs")).text
        assert "alpha-report" in everything and "beta-cleanup" in everything and "<th>Owner</th>" in everything
        assert (await admin.get(f"/ui/jobs/{mine}")).status_code == 200


async def test_name_search_is_a_case_insensitive_prefix_in_name_order_with_pages(
    client: httpx.AsyncClient, team_a: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ["backup-db", "Backup-files", "db-backup", "backup-logs", "BACKUP-mail", "reports"]:
        await create_job(client, job_body(name))
    monkeypatch.setattr(pages, "PAGE_SIZE", 2)

    def names(html: str) -> list[str]:
        return re.findall(r'class="job-link" href="[^"]+">([^<]+)</a>', html)

    first = (await team_a.get("/ui/jobs", params={"q": "BACK"})).text
    assert names(first) == ["backup-db", "Backup-files"]
    after = re.search(r'href="/ui/jobs\?q=BACK&show=all&after=([^"]+)">Next page', first)
    assert after, "no link to the next page"
    second = (await team_a.get("/ui/jobs", params={"q": "BACK", "after": after.group(1)})).text
    assert names(second) == ["backup-logs", "BACKUP-mail"]
    assert "Next page" not in second and "First page" in second  # exactly four match

    assert names((await team_a.get("/ui/jobs", params={"q": "zzz"})).text) == []
    garbage = await team_a.get("/ui/jobs", params={"after": "not-a-cursor!"})
    assert garbage.status_code == 200 and names(garbage.text) == ["backup-db", "Backup-files"]


async def test_failing_and_paused_filters(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, team_a: httpx.AsyncClient,
) -> None:
    target.responders["/fail"] = lambda _: 500
    soon = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    once = {"maxAttempts": 1}
    ok = await create_job(client, {**job_body("works", f"{target.url}/ok"), "schedule": {"at": soon}})
    bad = await create_job(client, {**job_body("breaks", f"{target.url}/fail"), "schedule": {"at": soon},
                                    "retryPolicy": once})
    idle = await create_job(client, job_body("idle"))

    async def last_status(job_id: str) -> str | None:
        last = (await client.get(f"/jobs/{job_id}")).json()["lastRun"]
        return last and last["status"]

    async def both_finished() -> bool:
        return await last_status(ok) == "succeeded" and await last_status(bad) == "failed"

    await wait_for(both_finished, timeout=30, what="both runs to finish")
    failing = (await team_a.get("/ui/jobs", params={"show": "failing"})).text
    assert "breaks" in failing and "works" not in failing and "idle" not in failing
    assert "500" in failing  # the last error is shown in the list

    token = csrf_of(failing)
    await team_a.post(f"/ui/jobs/{idle}/pause", data={"csrf": token})
    paused = (await team_a.get("/ui/jobs", params={"show": "paused"})).text
    assert "idle" in paused and "breaks" not in paused and "works" not in paused


async def test_job_and_run_pages_show_history_attempts_errors_and_actions(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, team_a: httpx.AsyncClient,
) -> None:
    target.responders["/flaky"] = lambda n: 503 if n == 1 else 200
    soon = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    job_id = await create_job(client, {**job_body("flaky-sync", f"{target.url}/flaky"), "schedule": {"at": soon},
                                       "retryPolicy": {"maxAttempts": 3, "initialBackoffSec": 1}})
    runs = await wait_for(lambda: _runs_with(client, job_id, "succeeded"), timeout=30, what="the retried run")
    run_id = runs[0]["runId"]

    job_page = await team_a.get(f"/ui/jobs/{job_id}")
    assert job_page.status_code == 200
    html = job_page.text
    assert "flaky-sync" in html and "status-succeeded" in html and 'data-chart="runs"' in html
    assert f"{target.url}/flaky" in html and "up to 3" in html

    run_page = (await team_a.get(f"/ui/runs/{run_id}")).text
    assert "Attempt 1" in run_page and "Attempt 2" in run_page and "503" in run_page
    assert "attempt 1 failed" in run_page and "attempt 2 succeeded" in run_page  # the timeline
    assert "2 of 3" in run_page

    rerun = await team_a.post(f"/ui/runs/{run_id}/rerun", data={"csrf": csrf_of(run_page)})
    assert rerun.status_code == 303
    new_run = rerun.headers["location"].split("/ui/runs/")[1].split("?")[0]
    assert new_run != run_id
    started = await team_a.post(f"/ui/jobs/{job_id}/run", data={"csrf": csrf_of(run_page)})
    manual = started.headers["location"].split("started=")[1]
    await wait_for(lambda: _runs_with(client, job_id, "succeeded", count=3), timeout=30, what="re-run and manual run")
    after = (await team_a.get(started.headers["location"])).text
    assert "Run started" in after and f'data-run-id="{manual}"' in after and "rerun" in after and "manual" in after

    filtered = (await team_a.get(f"/ui/jobs/{job_id}", params={"status": "failed"})).text
    assert "No failed runs." in filtered
    assert (await team_a.get("/ui/runs/00000000-0000-7000-8000-000000000000")).status_code == 404
    assert (await team_a.get("/ui/jobs/not-a-uuid")).status_code == 404


async def _runs_with(client: httpx.AsyncClient, job_id: str, status: str, count: int = 1) -> list[dict] | None:
    runs = (await client.get(f"/jobs/{job_id}/runs", params={"status": status})).json()["runs"]
    return runs if len(runs) >= count else None


async def test_fleet_page_shows_nodes_partitions_workers_queue_and_lag(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, team_a: httpx.AsyncClient, api_url: str,
    tokens: dict[str, str], database_url: str,
) -> None:
    await create_job(client, {**job_body("every-second", f"{target.url}/tick"),
                              "schedule": {"cron": "* * * * * *"}})
    await wait_for(lambda: len(target.calls_to("/tick")) >= 2, timeout=30, what="two ticks")
    await wait_for(lambda: len(fleet.node.leases.held) == 1024, timeout=10, what="all partitions held")
    host_and_pid = f"{socket.gethostname()} · {os.getpid()}"
    # An API server heartbeats on the catalog; a worker of release 0.1.0 records no release.
    catalog = await asyncpg.connect(database_url)
    try:
        await catalog.execute("INSERT INTO api_servers (server_id, hostname, pid, release) "
                              "VALUES ('test-api', 'api-host', 7, '0.2.0')")
        await catalog.execute("INSERT INTO workers (worker_id, hostname, pid, concurrency) "
                              "VALUES ('old-worker', 'old-host', 8, 4)")
    finally:
        await catalog.close()
    async with signed_in(api_url, tokens["admin"]) as admin:
        html = (await admin.get("/ui/fleet")).text
        fragment = await admin.get("/ui/fleet?fragment=body")
    assert "test-node" in html and "test-worker" in html and host_and_pid in html
    # Each process's release: the node's and the worker's (this one), the API server's, the old worker's.
    assert html.count(f'<code class="small">{__version__}</code>') >= 2
    assert "<h2>API servers</h2>" in html and "test-api" in html and "api-host · 7" in html
    assert "old-worker" in html and "0.1.0 or earlier" in html
    assert "1024/1024" in html and "0\u20131023" in html
    assert re.search(r"Fire lag, last 10 min.*?\(([\d,]+) runs", html, re.DOTALL).group(1) != "0"
    assert "runs waiting in the queue" in html
    for tier in ("high", "normal", "batch"):
        assert f"<td>{tier}</td>" in html
    assert fragment.text.lstrip().startswith('<div id="fleet-body"')

    # A team sees the fleet's health and its own runs, not what GET /queue keeps for admins: the
    # fleet-wide queue, and the hosts and pids of nodes and workers (their default ids name both).
    assert (await client.get("/queue")).status_code == 403
    for page in ((await team_a.get("/ui/fleet")).text, (await team_a.get("/ui/fleet?fragment=body")).text):
        assert "waiting in the queue" not in page and "<h2>Queue</h2>" not in page
        assert not any(f"<td>{tier}</td>" in page for tier in ("high", "normal", "batch"))
        assert host_and_pid not in page and "test-node" not in page and "test-worker" not in page
        assert "1024/1024" in page and "node 1" in page and "worker 1" in page


async def test_fleet_page_shows_the_move_under_way_and_the_last_ended(
    team_a: httpx.AsyncClient, api_url: str, tokens: dict[str, str], database_url: str,
) -> None:
    catalog = await asyncpg.connect(database_url)
    try:
        assert "Partition moves" not in (await team_a.get("/ui/fleet")).text  # no move yet: no table
        await catalog.execute(
            "INSERT INTO shard_moves (first_partition, last_partition, source_shard, target_shard, phase, passes,"
            " rows_copied, note, started_at, finished_at) VALUES"
            " (0, 99, NULL, 7, 'done', 3, 4200, NULL, now() - interval '1 hour', now() - interval '50 minutes'),"
            " (100, 199, NULL, 7, 'cancelled', 1, 10, 'a run of the range still ran after 60 s (--drain-timeout)',"
            "  now() - interval '20 minutes', now() - interval '19 minutes')")
        await catalog.execute(
            "INSERT INTO shard_moves (first_partition, last_partition, source_shard, target_shard, phase, passes,"
            " rows_copied, rows_per_sec, rows_left, note) VALUES"
            " (512, 767, 7, NULL, 'copying', 2, 123456, 2500, 250000, 'second pass')")
    finally:
        await catalog.close()
    async with signed_in(api_url, tokens["admin"]) as admin:
        pages = [(await admin.get("/ui/fleet")).text, (await admin.get("/ui/fleet?fragment=body")).text,
                 (await team_a.get("/ui/fleet")).text]
    for html in pages:
        table = html[html.index("<h2>Partition moves</h2>"):]
        table = table[:table.index("</section>")]
        rows = re.findall(r"<tr class=\"[^\"]*\">(.*?)</tr>", table, re.DOTALL)
        assert len(rows) == 3
        under_way, cancelled, done = (re.sub(r"<[^>]+>|\s+", " ", row).split() for row in rows)
        # The move under way first: its phase, rows copied and passes, rate, time left and note.
        assert " ".join(under_way).startswith("3 512\u2013767 shard 7 → catalog copying 123,456 in 2 passes "
                                              "2,500 rows/s 1 min 40 s second pass")
        assert " ".join(cancelled).startswith("2 100\u2013199 catalog → shard 7 cancelled 10 in 1 pass — — "
                                              "a run of the range still ran after 60 s (--drain-timeout)")
        assert " ".join(done).startswith("1 0\u201399 catalog → shard 7 done 4,200 in 3 passes — — —")
        assert "A move is under way" in table


def moves_text(page: str) -> str:
    """The "Partition moves" section as its text reads, tags and runs of spaces gone."""
    start = page.index("<h2>Partition moves</h2>")
    section = page[start:page.index("</section>", start)]
    return unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", section)))


async def test_fleet_page_and_metrics_say_when_a_moves_mover_is_gone(
    team_a: httpx.AsyncClient, api_url: str, tokens: dict[str, str], database_url: str,
) -> None:
    """A move fenced two minutes ago whose mover last beat a minute ago: gone, with what to run; its
    range fenced that long. The same move, beating, is alive; /metrics has the phase and both ages."""
    catalog = await asyncpg.connect(database_url)
    try:
        await catalog.execute(
            "INSERT INTO shard_moves (first_partition, last_partition, source_shard, target_shard, phase, passes,"
            " rows_copied, note, mover, heartbeat_at, fenced_at) VALUES"
            " (512, 767, NULL, 7, 'fenced', 3, 100, 'waiting for the range''s runs in flight', 'host-a:4242',"
            "  now() - interval '1 minute', now() - interval '2 minutes')")
        async with signed_in(api_url, tokens["admin"]) as admin:
            page = (await admin.get("/ui/fleet")).text
            scraped = (await admin.get("/metrics")).text
        table = moves_text(page)
        assert "fenced fenced for 2 min" in table, table
        assert "when its mover stopped: waiting for the range's runs in flight" in table, table
        assert re.search(r"Move 1: mover host-a:4242 gone since \S+Z \(no heartbeat for 60 s\): "
                         r"`chimes shards move --resume` takes it on, `--cancel` gives the range back", table), table
        assert "gone mover host-a:4242 gone since" in table, table
        assert 'chimes_shard_move_phase{phase="fenced"} 1.0' in scraped
        assert 'chimes_shard_move_phase{phase="copying"} 0.0' in scraped
        fenced, age = (float(re.findall(rf"^{name} (\S+)$", scraped, re.MULTILINE)[0])
                       for name in ("chimes_shard_move_fenced_seconds", "chimes_shard_move_heartbeat_age_seconds"))
        assert 119 < fenced < 130 and 59 < age < 70, (fenced, age)

        await catalog.execute("UPDATE shard_moves SET heartbeat_at = now()")
        async with signed_in(api_url, tokens["admin"]) as admin:
            page = (await admin.get("/ui/fleet")).text
        table = moves_text(page)
        assert "mover host-a:4242 alive, heartbeat 0 s ago" in table and "gone" not in table, table
        assert "(waiting for the range's runs in flight)" not in table  # the note, in its own cell
        assert " waiting for the range's runs in flight mover host-a:4242 alive" in table, table
    finally:
        await catalog.close()


async def test_static_assets_are_served_by_chimes_itself(api_url: str) -> None:
    async with httpx.AsyncClient(base_url=api_url, timeout=30) as browser:
        for name, kind in [("htmx.min.js", "javascript"), ("uPlot.iife.min.js", "javascript"),
                           ("dashboard.css", "css"), ("dashboard.js", "javascript"), ("favicon.svg", "svg")]:
            response = await browser.get(f"/ui/static/{name}")
            assert response.status_code == 200 and kind in response.headers["content-type"], name
        login = (await browser.get("/ui/login")).text
        assert "http://" not in login.replace('xmlns="http://www.w3.org', "") and "https://" not in login


@pytest.mark.single_database("the plan of one statement on one database")
@pytest.mark.parametrize("query, owner, index", [
    ("dashboard_jobs_of_owner", "team-a", "jobs_owner_name"),
    ("dashboard_jobs_of_all", None, "jobs_name"),
    ("dashboard_paused_jobs", None, "jobs_paused_name"),
])
async def test_job_lists_read_an_index_in_order_never_all_jobs(
    pool: asyncpg.Pool, query: str, owner: str | None, index: str,
) -> None:
    """With the alternatives off, the plan must be an ordered index range (no sort): it reads one page.

    (On a table this small the planner would rather sort; turning that off asks whether it could avoid it.)
    """
    async with pool.acquire() as conn, conn.transaction():
        for setting in ("enable_seqscan", "enable_bitmapscan", "enable_sort"):
            await conn.execute(f"SET LOCAL {setting} = off")
        await conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        statement = await conn.prepare(f"EXPLAIN {sql(query)}")
        plan = "\n".join(r[0] for r in await statement.fetch(owner, "back", uuid.UUID(int=0), "back\U0010ffff", 51))
    assert index in plan and "Sort" not in plan and "Seq Scan on jobs" not in plan, plan



# UUIDs whose time (the top 48 bits of a run id) is past year 9999, in version 4 and version 7.
FORGED_RUN_IDS = ("ffffffff-ffff-4fff-bfff-ffffffffffff", "ffffffff-ffff-7fff-bfff-ffffffffffff")


@pytest.mark.parametrize("action", ["page", "rerun", "cancel"])
async def test_forged_run_ids_are_not_found(client: httpx.AsyncClient, team_a: httpx.AsyncClient,
                                            action: str) -> None:
    """Ids a client made up, not ones the dashboard links to, answer 404, never 500."""
    job_id = await create_job(client, job_body("nightly"))
    token = csrf_of((await team_a.get(f"/ui/jobs/{job_id}")).text)
    for run_id in FORGED_RUN_IDS:
        if action == "page":
            answer = await team_a.get(f"/ui/runs/{run_id}")
        else:
            answer = await team_a.post(f"/ui/runs/{run_id}/{action}", data={"csrf": token})
        assert answer.status_code == 404 and "No such run" in answer.text, run_id


async def test_the_dashboard_and_the_api_agree_on_forged_run_ids(client: httpx.AsyncClient,
                                                                 team_a: httpx.AsyncClient) -> None:
    """One reading of ids from outside (chimes.ids) for both: a run id past year 9999 is 404 in each."""
    for run_id in FORGED_RUN_IDS:
        assert (await client.get(f"/runs/{run_id}")).status_code == 404, run_id
        assert (await team_a.get(f"/ui/runs/{run_id}")).status_code == 404, run_id


@pytest.mark.parametrize("job_id", ["not-a-uuid", "ffffffff-ffff-7fff-bfff-ffffffffffff"])
async def test_forged_job_ids_are_not_found(client: httpx.AsyncClient, team_a: httpx.AsyncClient,
                                            job_id: str) -> None:
    real = await create_job(client, job_body("nightly"))
    token = csrf_of((await team_a.get(f"/ui/jobs/{real}")).text)
    answers = [await team_a.get(f"/ui/jobs/{job_id}")]
    for action in ("run", "pause", "resume"):
        answers.append(await team_a.post(f"/ui/jobs/{job_id}/{action}", data={"csrf": token}))
    assert [(a.status_code, "No such job" in a.text) for a in answers] == [(404, True)] * 4
    shown = await team_a.get(f"/ui/jobs/{real}", params={"started": "ffffffff-ffff-7fff-bfff-ffffffffffff"})
    assert shown.status_code == 200


@pytest.mark.parametrize("before", ["_____________________w", "AAAAAAAAAAAAAAAAAAAAAA", "not-a-cursor!"])
async def test_a_forged_run_cursor_is_a_bad_request(client: httpx.AsyncClient, team_a: httpx.AsyncClient,
                                                    before: str) -> None:
    job_id = await create_job(client, job_body("nightly"))
    page = await team_a.get(f"/ui/jobs/{job_id}", params={"before": before})
    assert page.status_code == 400 and "not a link the dashboard made" in page.text
    assert (await team_a.get(f"/ui/jobs/{job_id}")).status_code == 200


async def test_search_text_with_nul_is_a_bad_request(client: httpx.AsyncClient, team_a: httpx.AsyncClient) -> None:
    await create_job(client, job_body("back\u00e9"))
    search = await team_a.get("/ui/jobs", params={"q": "\x00"})
    assert search.status_code == 400 and "NUL" in search.text
    cursor = pages._b64(uuid.uuid4().bytes + b"back\x00")  # a name with NUL: starts from the first page
    listed = await team_a.get("/ui/jobs", params={"after": cursor})
    assert listed.status_code == 200 and "back\u00e9" in listed.text


async def test_a_command_job_page_shows_its_directory_only_when_it_has_one(
    client: httpx.AsyncClient, pool: asyncpg.Pool, team_a: httpx.AsyncClient,
) -> None:
    """A command task without ``cwd`` (the usual case) made the job page a 500."""
    await OwnerStore(pool).set("team-a", allow_commands=True)
    plain = await create_job(client, {**job_body("plain-command"), "task": {"type": "command", "argv": ["true"]}})
    placed = await create_job(client, {**job_body("placed-command"),
                                       "task": {"type": "command", "argv": ["ls"], "cwd": "/srv/reports"}})
    without = await team_a.get(f"/ui/jobs/{plain}")
    assert without.status_code == 200, without.text
    assert "plain-command" in without.text and "Directory" not in without.text
    within = await team_a.get(f"/ui/jobs/{placed}")
    assert within.status_code == 200 and "/srv/reports" in within.text
