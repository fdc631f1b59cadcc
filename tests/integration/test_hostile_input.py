"""Hostile input: whatever a client sends, the API answers a clear 4xx (never a 5xx) and writes
nothing; and the limits (body size, writes per token, failed logins per address, jobs per owner)
answer 413 and 429 with messages that say what to do."""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
from collections import Counter

import asyncpg
import httpx
import pytest

from chimes.api.app import create_app
from chimes.api.limits import LimitSettings
from chimes.store.owners import OwnerStore
from tests.helpers import Homes, auth_as
from tests.integration.served import served
from tests.integration.test_jobs_api import HTTP_TASK, cron_job

JSON = {"Content-Type": "application/json"}


def nested(depth: int) -> bytes:
    return b'{"name": "deep", "schedule": {"cron": "* * * * *"}, "task": {"type": "http", "url": "http://x", ' \
           b'"body": ' + b"[" * depth + b"]" * depth + b"}}"


HOSTILE_BODIES = [
    ("deeply nested JSON", nested(100_000), 400),
    ("nested JSON deeper than Chimes stores", nested(500), 422),
    ("nested JSON as deep as Chimes stores", nested(31), 201),
    ("invalid UTF-8", b'{"name": "\xff\xfe\xfa", "schedule": {"cron": "* * * * *"}, "task": '
                      b'{"type": "http", "url": "http://x"}}', 400),
    ("lone surrogate escape", b'{"name": "\\ud800", "schedule": {"cron": "* * * * *"}, "task": '
                              b'{"type": "http", "url": "http://x"}}', 422),
    ("NaN", b'{"name": "n", "schedule": {"cron": "* * * * *"}, "timeoutSec": NaN, "task": {"type": "http", '
            b'"url": "http://x"}}', 422),
    ("a number with 5,000 digits", b'{"name": "n", "schedule": {"cron": "* * * * *"}, "timeoutSec": '
                                   + b"9" * 5000 + b', "task": {"type": "http", "url": "http://x"}}', 400),
    ("a JSON array, not an object", b"[1, 2, 3]", 422),
    ("empty body", b"", 422),
    ("NUL bytes in the name", b'{"name": "a\\u0000b", "schedule": {"cron": "* * * * *"}, "task": '
                              b'{"type": "http", "url": "http://x"}}', 422),
]


@pytest.mark.parametrize(("case", "body", "status"), HOSTILE_BODIES, ids=[c[0] for c in HOSTILE_BODIES])
async def test_hostile_bodies_get_a_clear_answer_and_never_a_5xx(
    client: httpx.AsyncClient, homes: Homes, case: str, body: bytes, status: int
) -> None:
    response = await client.post("/jobs", content=body, headers=JSON)
    assert response.status_code == status, response.text
    if status >= 400:
        error = response.json()
        assert error["error"] and error["message"], error
        assert await homes.total("SELECT count(*) FROM jobs") == 0
    if case in STORABLE_PROBLEMS:
        assert (response.json()["field"], response.json()["details"][0]["message"]) == STORABLE_PROBLEMS[case]


STORABLE_PROBLEMS = {
    "nested JSON deeper than Chimes stores": ("task.body", "is nested deeper than 32 levels"),
    "lone surrogate escape": ("name", "Input should be a valid string, unable to parse raw data as a unicode string"),
    "NUL bytes in the name": ("name", "contains a NUL character"),
}


HOSTILE_JOBS = [
    ("header injection in a task header", cron_job(task={**HTTP_TASK, "headers": {"X-A": "ok\r\nX-Injected: 1"}}),
     "task.headers", "line break"),
    ("header injection with a bare LF", cron_job(task={**HTTP_TASK, "headers": {"X-A": "ok\nX-Injected: 1"}}),
     "task.headers", "line break"),
    ("header injection in a secret header", cron_job(task={**HTTP_TASK, "secretHeaders": {"X-A": "v\r\n\r\nbody"}}),
     "task.secretHeaders", "line break"),
    ("a colon in a header name", cron_job(task={**HTTP_TASK, "headers": {"X-A: b": "v"}}), "task.headers", "pattern"),
    ("a space in a header name", cron_job(task={**HTTP_TASK, "headers": {"X A": "v"}}), "task.headers", "pattern"),
    ("the same header plain and secret",
     cron_job(task={**HTTP_TASK, "headers": {"x-key": "a"}, "secretHeaders": {"X-Key": "b"}}), "task",
     "both as a plain and as a secret"),
    ("a cron that never fires", cron_job(schedule={"cron": "0 0 30 2 *"}), "schedule.cron", "never fires"),
    ("a cron that never fires, with seconds", cron_job(schedule={"cron": "0 0 0 31 4 *"}), "schedule.cron",
     "never fires"),
    ("a time zone that does not exist", cron_job(schedule={"cron": "0 2 * * *", "timezone": "Mars/Olympus_Mons"}),
     "schedule.timezone", "unknown time zone"),
    ("a UTC offset as a time zone", cron_job(schedule={"cron": "0 2 * * *", "timezone": "UTC+25"}),
     "schedule.timezone", "unknown time zone"),
    ("a path as a time zone", cron_job(schedule={"cron": "0 2 * * *", "timezone": "/etc/localtime"}),
     "schedule.timezone", "unknown time zone"),
    ("a NUL in a time zone", cron_job(schedule={"cron": "0 2 * * *", "timezone": "Europe/Berlin\x00"}),
     "schedule.timezone", "contains a NUL character"),
    ("an empty time zone", cron_job(schedule={"cron": "0 2 * * *", "timezone": ""}), "schedule.timezone",
     "at least 1"),
    ("a file URL", cron_job(task={**HTTP_TASK, "url": "file:///etc/passwd"}), "task.url", "pattern"),
    ("a gopher URL", cron_job(task={**HTTP_TASK, "url": "gopher://127.0.0.1:25/"}), "task.url", "pattern"),
    # Tasks that could never succeed: every attempt failed (the client sends header values as ASCII,
    # and no connection is made to a port past 65535 or to a host left open).
    ("a non-ASCII header value", cron_job(task={**HTTP_TASK, "headers": {"X-Name": "Zoë"}}), "task.headers",
     "non-ASCII character 'ë'"),
    ("a non-ASCII secret header value", cron_job(task={**HTTP_TASK, "secretHeaders": {"X-Key": "clé"}}),
     "task.secretHeaders", "non-ASCII character 'é'"),
    ("a port past 65535", cron_job(task={**HTTP_TASK, "url": "http://127.0.0.1:65536/x"}), "task.url",
     "Port out of range"),
    ("port 0", cron_job(task={**HTTP_TASK, "url": "http://127.0.0.1:0/x"}), "task.url", "port 0 is not from 1"),
    ("user info in the task URL", cron_job(task={**HTTP_TASK, "url": "https://user:s3cret@127.0.0.1/x"}), "task.url",
     "the URL carries user info (user:password@), which Chimes does not send: put the credentials in "
     "task.secretHeaders"),
    ("an unclosed IPv6 bracket", cron_job(task={**HTTP_TASK, "url": "http://[::1"}), "task.url", "Invalid IPv6 URL"),
    ("a host that decodes to a slash", cron_job(task={**HTTP_TASK, "url": "http://a%2fb.example/"}), "task.url",
     "(decoded: 'a/b.example') is not a host name"),
    ("a host that decodes to a control character", cron_job(task={**HTTP_TASK, "url": "http://a%0d.example/"}),
     "task.url", "is not a host name"),
    ("a webhook port past 65535", cron_job(notifyUrl="http://127.0.0.1:99999/hook"), "notifyUrl",
     "Port out of range"),
    ("a webhook with an unclosed IPv6 bracket", cron_job(notifyUrl="http://[::1"), "notifyUrl", "Invalid IPv6 URL"),
    ("a webhook host that decodes to an at sign", cron_job(notifyUrl="http://me%40evil.example/"), "notifyUrl",
     "is not a host name"),
    ("the redacted marker as a new secret", cron_job(task={**HTTP_TASK, "secretHeaders": {"X-Key": "********"}}),
     "task.secretHeaders.X-Key", "no stored secret"),
]


@pytest.mark.parametrize(("case", "body", "field", "words"), HOSTILE_JOBS, ids=[c[0] for c in HOSTILE_JOBS])
async def test_hostile_jobs_are_refused_naming_the_field(
    client: httpx.AsyncClient, homes: Homes, case: str, body: dict, field: str, words: str
) -> None:
    response = await client.post("/jobs", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["field"].startswith(field), response.json()
    assert words in response.json()["message"], response.json()
    assert "s3cret" not in response.text, "a secret in the input is not repeated"
    assert await homes.total("SELECT count(*) FROM jobs") == 0


async def test_huge_bodies_are_cut_off_at_the_limit(database_url: str, tokens: dict[str, str],
                                                    homes: Homes) -> None:
    app = create_app(database_url, pool_size=2, limits=LimitSettings(max_body_bytes=64 * 1024))
    async with served(app) as url, httpx.AsyncClient(base_url=url, headers=auth_as(tokens["team-a"])) as http:
        declared = await http.post("/jobs", json=cron_job(task={**HTTP_TASK, "body": "x" * 100_000}))

        async def chunks():  # no Content-Length: 50 MiB, cut off after the first 64 KiB
            for _ in range(800):
                yield b"[" * 65536

        streamed = await http.post("/jobs", content=chunks(), headers=JSON)
        fits = await http.post("/jobs", json=cron_job(task={**HTTP_TASK, "body": "x" * 30_000}))
    for response in (declared, streamed):
        assert response.status_code == 413
        assert response.json()["message"] == "request body is larger than the limit of 65536 bytes"
    assert fits.status_code == 201
    assert await homes.total("SELECT count(*) FROM jobs") == 1


async def test_writes_beyond_the_token_rate_get_429_with_retry_after(database_url: str, tokens: dict[str, str],
                                                                     homes: Homes) -> None:
    limits = LimitSettings(writes_per_sec=0.1, write_burst=3)
    async with served(create_app(database_url, pool_size=2, limits=limits)) as url, \
            httpx.AsyncClient(base_url=url) as http:
        made = [await http.post("/jobs", json=cron_job(name=f"j{i}"), headers=auth_as(tokens["team-a"]))
                for i in range(4)]
        other_token = await http.post("/jobs", json=cron_job(name="b"), headers=auth_as(tokens["team-b"]))
        reads = await http.get("/jobs", headers=auth_as(tokens["team-a"]))
    assert [r.status_code for r in made] == [201, 201, 201, 429]
    refused = made[3]
    assert refused.json()["error"] == "rate_limited"
    assert refused.json()["message"].startswith("too many writes with this token: at most 0.1 a second (bursts of 3)")
    assert 1 <= int(refused.headers["retry-after"]) <= 10
    assert other_token.status_code == 201, "the limit is per token"
    assert reads.status_code == 200, "reads are not limited"
    assert await homes.total("SELECT count(*) FROM jobs WHERE owner = 'team-a'") == 3


async def test_failed_logins_are_limited_per_address_and_logged_without_the_token(
    database_url: str, tokens: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    limits = LimitSettings(auth_failures_per_min=1, auth_failure_burst=3)
    guesses = [f"chm_guess{i}" for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="chimes.api.auth"):
        async with served(create_app(database_url, pool_size=2, limits=limits)) as url, \
                httpx.AsyncClient(base_url=url) as http:
            same = [await http.get("/jobs", headers=auth_as("chm_same-wrong-token")) for _ in range(5)]
            tried = [await http.get("/jobs", headers=auth_as(guess)) for guess in guesses]
            valid_now = await http.get("/jobs", headers=auth_as(tokens["team-a"]))
            health = await http.get("/healthz")
    assert [r.status_code for r in same] == [401] * 5, "one wrong token, repeated, counts once"
    assert [r.status_code for r in tried] == [401, 401, 429, 429]
    assert tried[2].json()["error"] == "too_many_failed_logins"
    assert tried[2].json()["message"].startswith("too many failed authentication attempts from 127.0.0.1")
    assert int(tried[2].headers["retry-after"]) > 0
    assert valid_now.status_code == 429, "the address waits, whatever it sends"
    assert health.status_code == 200
    failures = [r.getMessage() for r in caplog.records if "authentication failed" in r.getMessage()]
    assert failures == ["authentication failed from 127.0.0.1: GET /jobs"] * 3
    assert not any(guess in caplog.text for guess in [*guesses, "chm_same-wrong-token"])


GUESSES = 200
# The budget at once, and a refill too slow to add a guess while a test runs.
GUESS_LIMITS = LimitSettings(auth_failures_per_min=0.01, auth_failure_burst=20)


async def at_once(url: str, requests: list[dict]) -> list[httpx.Response]:
    """``requests`` sent together, each on a connection of its own, from 127.0.0.1."""
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=len(requests))) as http:
        return await asyncio.gather(*(http.request(**request) for request in requests))


async def test_guesses_sent_at_once_get_no_more_401s_than_the_budget(database_url: str,
                                                                     tokens: dict[str, str]) -> None:
    """Each guess is charged as it is checked, not when its answer is sent: 200 guesses sent at once
    were all checked before the first was counted, and most of them answered 401."""
    guesses = [{"method": "GET", "url": "/jobs", "headers": auth_as(f"chm_{secrets.token_urlsafe(32)}")}
               for _ in range(GUESSES)]
    async with served(create_app(database_url, pool_size=4, limits=GUESS_LIMITS)) as url:
        answers = await at_once(url, guesses)
    statuses = Counter(a.status_code for a in answers)
    assert statuses[401] <= GUESS_LIMITS.auth_failure_burst, statuses
    assert statuses[401] + statuses[429] == GUESSES, statuses
    assert all(a.json()["error"] == "too_many_failed_logins" for a in answers if a.status_code == 429)


async def test_sign_in_guesses_sent_at_once_get_no_more_refusals_than_the_budget(database_url: str) -> None:
    guesses = [{"method": "POST", "url": "/ui/login", "data": {"token": f"chm_{secrets.token_urlsafe(32)}"}}
               for _ in range(GUESSES)]
    async with served(create_app(database_url, pool_size=4, limits=GUESS_LIMITS)) as url:
        answers = await at_once(url, guesses)
    statuses = Counter(a.status_code for a in answers)
    assert statuses[401] <= GUESS_LIMITS.auth_failure_burst, statuses
    assert statuses[401] + statuses[429] == GUESSES, statuses


async def test_a_valid_token_sent_at_once_from_a_fresh_address_is_never_refused(database_url: str,
                                                                                 tokens: dict[str, str]) -> None:
    """A guess is charged before it is checked; a token that holds costs nothing, however many
    requests carry it at once."""
    requests = [{"method": "GET", "url": "/jobs", "headers": auth_as(tokens["team-a"])} for _ in range(GUESSES)]
    async with served(create_app(database_url, pool_size=4, limits=GUESS_LIMITS)) as url:
        answers = await at_once(url, requests)
        after = await at_once(url, [{"method": "GET", "url": "/jobs", "headers": auth_as(f"chm_guess{i}")}
                                    for i in range(GUESS_LIMITS.auth_failure_burst + 1)])
    assert Counter(a.status_code for a in answers) == {200: GUESSES}
    assert Counter(a.status_code for a in after) == {401: GUESS_LIMITS.auth_failure_burst, 429: 1}, \
        "the whole budget is left for the address"


async def test_forwarded_addresses_count_only_from_trusted_proxies(
    database_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A client that names another address in each request must not get more guesses, unless the
    connection comes from a proxy the operator trusts (--trusted-proxy)."""
    limits = LimitSettings(auth_failures_per_min=1, auth_failure_burst=3)

    def guess(i: int, address: str) -> dict[str, str]:
        return {**auth_as(f"chm_guess{i}"), "X-Forwarded-For": address}

    async with served(create_app(database_url, pool_size=2, limits=limits)) as url, \
            httpx.AsyncClient(base_url=url) as http:
        rotating = [await http.get("/jobs", headers=guess(i, f"203.0.113.{i}")) for i in range(5)]
    assert [r.status_code for r in rotating] == [401, 401, 401, 429, 429], "by default no proxy is trusted"
    assert rotating[3].json()["message"].startswith("too many failed authentication attempts from 127.0.0.1")

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="chimes.api.auth"):
        async with served(create_app(database_url, pool_size=2, limits=limits), trusted_proxies=("127.0.0.0/8",)) \
                as url, httpx.AsyncClient(base_url=url) as http:
            others = [await http.get("/jobs", headers=guess(i, f"198.51.100.{i}")) for i in range(5)]
            one = [await http.get("/jobs", headers=guess(10 + i, "192.0.2.7")) for i in range(4)]
    assert [r.status_code for r in others] == [401] * 5, "behind a trusted proxy, each client has its own limit"
    assert [r.status_code for r in one] == [401, 401, 401, 429]
    assert one[3].json()["message"].startswith("too many failed authentication attempts from 192.0.2.7")
    assert "authentication failed from 198.51.100.4: GET /jobs" in caplog.text


async def test_job_quota_holds_exactly_under_concurrent_creates(database_url: str, tokens: dict[str, str],
                                                                pool: asyncpg.Pool, homes: Homes) -> None:
    await OwnerStore(pool).set("team-a", job_quota=5)
    limits = LimitSettings(default_job_quota=2, write_burst=1000)
    async with served(create_app(database_url, pool_size=8, limits=limits)) as url, \
            httpx.AsyncClient(base_url=url, timeout=30) as http:
        answers = await asyncio.gather(*[
            http.post("/jobs", json=cron_job(name=f"a{i}"), headers=auth_as(tokens["team-a"])) for i in range(12)
        ])
        team_b = [await http.post("/jobs", json=cron_job(name=f"b{i}"), headers=auth_as(tokens["team-b"]))
                  for i in range(3)]
        first = (await http.get("/jobs", headers=auth_as(tokens["team-a"]))).json()["jobs"][0]["jobId"]
        assert (await http.delete(f"/jobs/{first}", headers=auth_as(tokens["team-a"]))).status_code == 204
        after_delete = await http.post("/jobs", json=cron_job(name="again"), headers=auth_as(tokens["team-a"]))
    statuses = sorted(r.status_code for r in answers)
    assert statuses == [201] * 5 + [429] * 7
    refused = next(r for r in answers if r.status_code == 429).json()
    assert refused["error"] == "job_quota_exceeded"
    assert refused["message"] == ("owner 'team-a' already has 5 jobs, its quota: delete jobs, or ask an operator "
                                  "to raise it (chimes owner set team-a --job-quota N)")
    assert [r.status_code for r in team_b] == [201, 201, 429], "team-b has the default quota of 2"
    assert after_delete.status_code == 201
    assert await homes.total("SELECT count(*) FROM jobs WHERE owner = 'team-a'") == 5
    assert await homes.total("SELECT count(*) FROM triggers t JOIN jobs j USING (job_id)") == 7


async def test_an_idempotent_retry_at_the_quota_returns_the_job(database_url: str, tokens: dict[str, str],
                                                                pool: asyncpg.Pool) -> None:
    await OwnerStore(pool).set("team-a", job_quota=1)
    async with served(create_app(database_url, pool_size=2)) as url, \
            httpx.AsyncClient(base_url=url, headers=auth_as(tokens["team-a"])) as http:
        first = await http.post("/jobs", json=cron_job(), headers={"Idempotency-Key": "k1"})
        retry = await http.post("/jobs", json=cron_job(), headers={"Idempotency-Key": "k1"})
    assert (first.status_code, retry.status_code) == (201, 200)
    assert retry.json()["jobId"] == first.json()["jobId"]


async def test_dashboard_sign_in_guesses_count_each(database_url: str) -> None:
    """The sign-in form carries the token in its body: every wrong one counts against the address."""
    limits = LimitSettings(auth_failures_per_min=1, auth_failure_burst=2)
    async with served(create_app(database_url, pool_size=2, limits=limits)) as url, \
            httpx.AsyncClient(base_url=url) as http:
        tries = [await http.post("/ui/login", data={"token": f"chm_guess{i}", "next": "/ui/jobs"}) for i in range(3)]
    assert [t.status_code for t in tries] == [401, 401, 429]


async def test_each_failed_credential_counts_whichever_part_of_the_request_carried_it(database_url: str) -> None:
    """Guesses counted under the wrong key were free: a fixed cookie before a varying Authorization
    made every guess one credential, session cookie guesses answered with the dashboard's redirect
    were never counted, and the sign-in form counted once when its body was not a form or a fixed
    Authorization header came with it. Each wrong token now counts, wherever it was."""
    limits = LimitSettings(auth_failures_per_min=1, auth_failure_burst=3)

    async def statuses(requests: list[dict]) -> list[int]:
        async with served(create_app(database_url, pool_size=2, limits=limits)) as url, \
                httpx.AsyncClient(base_url=url) as http:
            return [(await http.request(**request)).status_code for request in requests]

    cookie_first = [{"method": "GET", "url": "/jobs", "headers": [("Cookie", "chimes_session=chm_fixed"),
                                                                   ("Authorization", f"Bearer chm_guess{i}")]}
                    for i in range(5)]
    assert await statuses(cookie_first) == [401, 401, 401, 429, 429]

    polling = [{"method": "GET", "url": "/ui/jobs", "headers": {"Cookie": "chimes_session=chm_expired"}}] * 5
    cookie_guesses = [{"method": "GET", "url": "/ui/jobs", "headers": {"Cookie": f"chimes_session=chm_guess{i}"}}
                      for i in range(3)]
    assert await statuses(polling + cookie_guesses) == [303] * 5 + [303, 303, 429], \
        "an expired session polled again counts once; each guessed cookie counts"

    plain_text = [{"method": "POST", "url": "/ui/login", "content": f"token=chm_guess{i}&next=/ui/jobs",
                   "headers": {"Content-Type": "text/plain"}} for i in range(4)]
    assert await statuses(plain_text) == [401, 401, 401, 429]

    fixed_header = [{"method": "POST", "url": "/ui/login", "data": {"token": f"chm_guess{i}"},
                     "headers": {"Authorization": "Bearer chm_fixed"}} for i in range(4)]
    assert await statuses(fixed_header) == [401, 401, 401, 429]


async def test_a_forged_cursor_is_a_clear_400(client: httpx.AsyncClient) -> None:
    job_id = (await client.post("/jobs", json=cron_job())).json()["jobId"]
    far_future = base64.urlsafe_b64encode(b"\xff" * 16).decode().rstrip("=")  # a run id dated past year 9999
    for cursor in (far_future, "!!!", "A" * 100):
        response = await client.get(f"/jobs/{job_id}/runs", params={"cursor": cursor})
        assert response.status_code in (400, 422), (cursor, response.text)
        assert response.json()["field"] == "cursor"
