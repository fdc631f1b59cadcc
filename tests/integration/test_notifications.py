"""Final-failure notifications: one per run that fails for good, never one per attempt, through an
outbox that survives the sender dying."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx
import orjson

from chimes.notifier import Notifier, NotifierConfig
from chimes.security.secrets import default_keyring
from chimes.security.signing import SIGNATURE_HEADER, verify
from chimes.services.owners import SigningSecrets, signing_secret
from chimes.store.owners import OwnerStore
from chimes.store.settings import change_everywhere
from tests.helpers import Homes, auth_as, wait_for
from tests.integration.fleet import Fleet
from tests.target import Target


def failing_job(target: Target, **extra: object) -> dict:
    at = (datetime.now(UTC) + timedelta(seconds=0.5)).isoformat()
    return {"name": "doomed", "schedule": {"at": at}, "task": {"type": "http", "url": target.url + "/fail"},
            "retryPolicy": {"maxAttempts": 3, "initialBackoffSec": 0.2, "jitter": 0}} | extra


async def test_a_run_that_fails_every_attempt_notifies_once(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, pool: asyncpg.Pool, homes: Homes
) -> None:
    target.responders["/fail"] = lambda n: 500
    job_id = (await client.post("/jobs", json=failing_job(target, notifyUrl=target.url + "/alerts"))).json()["jobId"]
    calls = await wait_for(lambda: target.calls_to("/alerts"), timeout=30, what="the failure notification")
    assert len(target.calls_to("/fail")) == 3  # three attempts...
    await wait_for(lambda: _all_sent(homes), timeout=10, what="the outbox to be marked sent")
    assert len(target.calls_to("/alerts")) == 1  # ...one notification
    payload = orjson.loads(calls[0].body)
    assert payload["kind"] == "run_failed" and payload["jobId"] == job_id and payload["attempt"] == 3
    assert payload["error"] == "HTTP 500" and payload["jobName"] == "doomed"
    assert calls[0].headers["Idempotency-Key"] == calls[0].headers["X-Chimes-Notification-Id"]
    # Signed like a task call, with the job owner's secret; no other secret verifies it.
    secret = await signing_secret(OwnerStore(pool), "team-a", default_keyring())
    signed, now = calls[0].headers[SIGNATURE_HEADER], time.time()
    assert verify(secret, signed, calls[0].body, now)
    assert not verify(secret, signed, calls[0].body + b" ", now)
    other = await signing_secret(OwnerStore(pool), "team-b", default_keyring())
    assert not verify(other, signed, calls[0].body, now)


async def _all_sent(homes: Homes) -> bool:
    return await homes.total("SELECT count(*) FROM notifications WHERE sent_at IS NULL") == 0


async def test_default_webhook_from_settings_and_no_notification_without_one(
    fleet: Fleet, client: httpx.AsyncClient, target: Target, pool: asyncpg.Pool, homes: Homes
) -> None:
    target.responders["/fail"] = lambda n: 500
    quiet = (await client.post("/jobs", json=failing_job(target, name="quiet"))).json()["jobId"]
    await wait_for(lambda: _failed(homes, quiet), timeout=30, what="the first job to fail")
    assert await homes.total("SELECT count(*) FROM notifications") == 0
    async with pool.acquire() as conn:  # as `chimes config set notify-url` does: in every home
        await change_everywhere(conn, "notify_url", target.url + "/default")
    loud = (await client.post("/jobs", json=failing_job(target, name="loud"))).json()["jobId"]
    calls = await wait_for(lambda: target.calls_to("/default"), timeout=30, what="the default webhook")
    assert orjson.loads(calls[0].body)["jobId"] == loud


async def _failed(homes: Homes, job_id: str) -> bool:
    return await homes.fetchval(job_id, "SELECT status FROM runs WHERE job_id = $1", uuid.UUID(job_id)) == "failed"


async def test_notification_claimed_by_a_sender_that_died_is_sent_once_by_another(
    client: httpx.AsyncClient, target: Target, pool: asyncpg.Pool
) -> None:
    """A sender SIGKILLed after claiming leaves exactly this in the database: a claimed row, unsent.
    (Claimed here by SQL, as the dead sender did; no process is killed in this test.)"""
    notification_id = uuid.uuid4()
    await pool.execute(
        "INSERT INTO notifications (notification_id, job_id, owner, kind, url, payload) "
        "VALUES ($1, $2, 'team-a', 'run_failed', $3, '{\"kind\": \"run_failed\"}')",
        notification_id, uuid.uuid4(), target.url + "/alerts")
    signer = SigningSecrets(pool)
    dead = Notifier(pool, signer, NotifierConfig(lease_sec=1.0))
    claimed = await pool.fetch("UPDATE notifications SET attempts = 1, next_attempt_at = now() + interval '1 second' "
                               "RETURNING notification_id")
    assert len(claimed) == 1
    survivor = Notifier(pool, signer, NotifierConfig(lease_sec=1.0))
    try:
        assert await survivor.deliver_due() == 0  # still leased by the dead sender
        await wait_for(survivor.deliver_due, timeout=10, what="the lease to run out and the resend")
        assert await survivor.deliver_due() == 0
    finally:
        await survivor.close()
        await dead.close()
    calls = target.calls_to("/alerts")
    assert len(calls) == 1 and calls[0].headers["Idempotency-Key"] == str(notification_id)


async def test_failed_delivery_is_retried_with_backoff(
    client: httpx.AsyncClient, target: Target, pool: asyncpg.Pool
) -> None:
    target.responders["/flaky-alerts"] = lambda n: 503 if n == 1 else 200
    await pool.execute(
        "INSERT INTO notifications (notification_id, job_id, owner, kind, url, payload) "
        "VALUES ($1, $2, 'team-a', 'run_failed', $3, '{}')", uuid.uuid4(), uuid.uuid4(), target.url + "/flaky-alerts")
    notifier = Notifier(pool, SigningSecrets(pool))
    try:
        assert await notifier.deliver_due() == 0
        row = await pool.fetchrow("SELECT * FROM notifications")
        assert row["last_error"] == "HTTP 503" and row["sent_at"] is None and row["attempts"] == 1
        await pool.execute("UPDATE notifications SET next_attempt_at = now()")  # the backoff has passed
        assert await notifier.deliver_due() == 1
    finally:
        await notifier.close()
    assert len(target.calls_to("/flaky-alerts")) == 2


async def test_an_undeliverable_notification_is_dead_lettered_and_listed_for_its_owner(
    client: httpx.AsyncClient, target: Target, pool: asyncpg.Pool, tokens: dict[str, str]
) -> None:
    target.responders["/broken-alerts"] = lambda n: 500
    given_up, fresh = uuid.uuid4(), uuid.uuid4()
    job_id = uuid.uuid4()
    for notification_id, age in ((given_up, timedelta(hours=25)), (fresh, timedelta(minutes=1))):
        await pool.execute(
            "INSERT INTO notifications (notification_id, job_id, owner, kind, url, payload, created_at) "
            "VALUES ($1, $2, 'team-a', 'run_failed', $3, '{}', now() - $4::interval)",
            notification_id, job_id, target.url + "/broken-alerts", age)
    notifier = Notifier(pool, SigningSecrets(pool))  # gives up 24 hours after a notification was queued
    try:
        assert await notifier.deliver_due() == 0
        await pool.execute("UPDATE notifications SET next_attempt_at = now()")  # every backoff has passed
        assert await notifier.deliver_due() == 0
    finally:
        await notifier.close()
    # The one queued 25 hours ago was tried once and given up; the fresh one is still being tried.
    assert len([c for c in target.calls_to("/broken-alerts") if c.headers["Idempotency-Key"] == str(given_up)]) == 1
    assert len(target.calls_to("/broken-alerts")) == 3
    dead = (await client.get("/notifications", params={"status": "dead"})).json()["notifications"]
    assert [n["notificationId"] for n in dead] == [str(given_up)]
    assert dead[0]["status"] == "dead" and dead[0]["lastError"] == "HTTP 500" and dead[0]["deadAt"] is not None
    assert dead[0]["jobId"] == str(job_id) and dead[0]["attempts"] == 1
    pending = (await client.get("/notifications", params={"status": "pending"})).json()["notifications"]
    assert [n["notificationId"] for n in pending] == [str(fresh)]
    everything = (await client.get("/notifications", params={"limit": 1})).json()
    assert [n["notificationId"] for n in everything["notifications"]] == [str(fresh)]  # newest first
    rest = (await client.get("/notifications", params={"limit": 1, "cursor": everything["nextCursor"]})).json()
    assert [n["notificationId"] for n in rest["notifications"]] == [str(given_up)] and rest["nextCursor"] is None
    # Scoped to the owner: another team sees none of them, an admin sees them all.
    other = await client.get("/notifications", params={"status": "dead"}, headers=auth_as(tokens["team-b"]))
    assert other.status_code == 200 and other.json()["notifications"] == []
    admin = await client.get("/notifications", params={"status": "dead"}, headers=auth_as(tokens["admin"]))
    assert [n["notificationId"] for n in admin.json()["notifications"]] == [str(given_up)]
    assert (await client.get("/notifications", params={"status": "lost"})).status_code == 422


async def _notify(pool: asyncpg.Pool, url: str) -> tuple[int, asyncpg.Record]:
    await pool.execute(
        "INSERT INTO notifications (notification_id, job_id, owner, kind, url, payload) "
        "VALUES ($1, $2, 'team-a', 'run_failed', $3, '{\"kind\": \"run_failed\"}')", uuid.uuid4(), uuid.uuid4(), url)
    notifier = Notifier(pool, SigningSecrets(pool))
    try:
        delivered = await notifier.deliver_due()
    finally:
        await notifier.close()
    return delivered, await pool.fetchrow("SELECT * FROM notifications")


async def test_a_webhook_is_not_followed_to_another_origin(
    target: Target, other_target: Target, pool: asyncpg.Pool
) -> None:
    for status in (302, 307, 308):
        target.redirects[f"/moved-{status}"] = other_target.url + "/collect"
        target.responders[f"/moved-{status}"] = lambda n, status=status: status
        delivered, row = await _notify(pool, f"{target.url}/moved-{status}")
        assert delivered == 0 and row["sent_at"] is None
        assert row["last_error"] == (f"HTTP {status}: redirect to {other_target.url}/collect not followed: a webhook "
                                     "goes to the origin it names, with its signature")
        await pool.execute("DELETE FROM notifications")
    assert other_target.calls == [], "nothing, and no signature, reached the other origin"


async def test_a_webhook_follows_a_307_within_its_origin_signed(target: Target, pool: asyncpg.Pool) -> None:
    target.redirects["/old-alerts"] = "/alerts"
    delivered, row = await _notify(pool, f"{target.url}/old-alerts")
    assert delivered == 1 and row["sent_at"] is not None
    [call] = target.calls_to("/alerts")
    secret = await signing_secret(OwnerStore(pool), "team-a", default_keyring())
    assert verify(secret, call.headers[SIGNATURE_HEADER], call.body, time.time())
