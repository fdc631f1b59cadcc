"""Secret header and environment values: sealed in the database, never shown by the API nor logged,
opened only by the worker for the call itself; and one secret key for every process."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx
import pytest

from chimes.api.app import create_app
from chimes.security.secrets import REDACTED, Keyring, SecretKeyError, default_keyring
from chimes.services.owners import OwnerCache, check_secret_key, signing_secret
from chimes.store.owners import OwnerStore
from chimes.store.working import ClaimedRun
from chimes.worker.guard import TaskGuard
from chimes.worker.worker import Worker
from tests.helpers import Homes, auth_as, wait_for
from tests.integration.fleet import FAST_WORKER, Fleet
from tests.integration.served import served
from tests.integration.test_outgoing_calls import final_run, one_off
from tests.target import Target

SECRET = "Bearer s3cret-value-0xC0FFEE"


def secret_job(target: Target, path: str = "/hook") -> dict:
    return one_off("with a secret", {"type": "http", "url": f"{target.url}{path}", "headers": {"X-Plain": "p"},
                                     "secretHeaders": {"Authorization": SECRET}})


async def test_secret_headers_reach_the_target_and_nothing_else(
    fleet: Fleet, client: httpx.AsyncClient, homes: Homes, target: Target, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    created = await client.post("/jobs", json=secret_job(target))
    assert created.status_code == 201, created.text
    job_id = created.json()["jobId"]
    shown = (await client.get(f"/jobs/{job_id}")).json()
    assert shown["task"]["secretHeaders"] == {"Authorization": REDACTED}
    assert shown["task"]["headers"] == {"X-Plain": "p"}
    listed = (await client.get("/jobs")).json()["jobs"][0]
    assert listed["task"]["secretHeaders"] == {"Authorization": REDACTED}
    row = await homes.fetchrow(job_id, "SELECT * FROM jobs WHERE job_id = $1", created.json()["jobId"])
    assert "s3cret" not in str(dict(row)), "stored sealed"

    run = await final_run(client, job_id)
    assert run["status"] == "succeeded", run
    assert target.calls[0].headers["Authorization"] == SECRET
    assert target.calls[0].headers["X-Plain"] == "p"
    assert "s3cret" not in str(run)
    assert "s3cret" not in caplog.text, "never logged"


async def test_secrets_survive_edits_unless_replaced(fleet: Fleet, client: httpx.AsyncClient, target: Target) -> None:
    job_id = (await client.post("/jobs", json=secret_job(target, "/one"))).json()["jobId"]
    renamed = await client.patch(f"/jobs/{job_id}", json={"name": "renamed"})
    assert renamed.status_code == 200 and renamed.json()["task"]["secretHeaders"] == {"Authorization": REDACTED}
    # A task given again with the redacted value keeps the stored secret, and can add another one.
    task = {**renamed.json()["task"], "url": f"{target.url}/two"}
    task["secretHeaders"] = {**task["secretHeaders"], "X-Api-Key": "k-2"}
    at = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    kept = await client.patch(f"/jobs/{job_id}", json={"task": task, "schedule": {"at": at}})
    assert kept.status_code == 200, kept.text
    await wait_for(lambda: target.calls_to("/two"), timeout=30, what="the edited job's call")
    call = target.calls_to("/two")[0]
    assert (call.headers["Authorization"], call.headers["X-Api-Key"]) == (SECRET, "k-2")
    # Giving the redacted value for a name that holds no secret is an error, and changes nothing.
    bad = await client.patch(f"/jobs/{job_id}", json={"task": {**task, "secretHeaders": {"X-New": REDACTED}}})
    assert bad.status_code == 422
    assert bad.json()["field"] == "task.secretHeaders.X-New"
    assert (await client.get(f"/jobs/{job_id}")).json()["version"] == kept.json()["version"]


async def test_secret_env_reaches_the_command_only(
    pool: asyncpg.Pool, database_url: str, client: httpx.AsyncClient, fleet: Fleet
) -> None:
    await OwnerStore(pool).set("team-a", allow_commands=True)
    fleet.worker.guard.allow_commands = True
    script = 'test "$API_KEY" = "k-123" && test "$PLAIN" = "p" && echo matched'
    job = one_off("env", {"type": "command", "argv": ["sh", "-c", script], "env": {"PLAIN": "p"},
                          "secretEnv": {"API_KEY": "k-123"}})
    created = await client.post("/jobs", json=job)
    assert created.status_code == 201, created.text
    assert (await client.get(f"/jobs/{created.json()['jobId']}")).json()["task"]["secretEnv"] == {"API_KEY": REDACTED}
    run = await final_run(client, created.json()["jobId"])
    assert run["status"] == "succeeded", run
    assert run["attempts"][0]["output"].strip() == "matched"


async def test_an_idempotent_retry_with_secrets_is_recognised(client: httpx.AsyncClient, pool: asyncpg.Pool,
                                                              target: Target) -> None:
    job = secret_job(target)
    first = await client.post("/jobs", json=job, headers={"Idempotency-Key": "s-1"})
    again = await client.post("/jobs", json=job, headers={"Idempotency-Key": "s-1"})
    other = await client.post("/jobs", json={**job, "task": {**job["task"], "secretHeaders": {"Authorization": "x"}}},
                              headers={"Idempotency-Key": "s-1"})
    assert (first.status_code, again.status_code, other.status_code) == (201, 200, 409)
    assert again.json()["jobId"] == first.json()["jobId"]


async def test_a_worker_with_another_key_refuses_to_start(pool: asyncpg.Pool, database_url: str) -> None:
    await check_secret_key(pool, default_keyring())  # the database now belongs to the default key
    stranger = Keyring.generate()
    with pytest.raises(SecretKeyError, match="is not the key the secrets in this database are sealed with"):
        await check_secret_key(pool, stranger)
    worker = Worker(pool, database_url, replace(FAST_WORKER), guard=TaskGuard(pool, stranger))
    with pytest.raises(SecretKeyError):
        await worker.run()


async def test_an_api_with_another_key_refuses_to_start(database_url: str, pool: asyncpg.Pool,
                                                        tokens: dict[str, str]) -> None:
    await check_secret_key(pool, default_keyring())
    stranger = create_app(database_url, pool_size=2, keyring=Keyring.generate())
    with pytest.raises(SecretKeyError, match="is not the key the secrets in this database are sealed with"):
        async with stranger.router.lifespan_context(stranger):
            pass
    async with served(create_app(database_url, pool_size=2, keyring=default_keyring())) as url:
        async with httpx.AsyncClient(base_url=url, headers=auth_as(tokens["team-a"])) as http:
            assert (await http.get("/jobs")).status_code == 200


class CountingOwnerStore(OwnerStore):
    """The real store, counting the reads of signing secrets."""

    reads = 0

    async def sealed_signing_secret(self, owner: str) -> str | None:
        self.reads += 1
        return await super().sealed_signing_secret(owner)


async def test_runs_that_miss_the_owner_cache_together_share_one_read(pool: asyncpg.Pool) -> None:
    keyring = default_keyring()
    await check_secret_key(pool, keyring)
    store = CountingOwnerStore(pool)
    cache = OwnerCache(store, keyring, ttl_sec=30.0)
    first = asyncio.ensure_future(cache.signing_secret("team-shared-read"))
    others = [asyncio.ensure_future(cache.signing_secret("team-shared-read")) for _ in range(49)]
    await asyncio.sleep(0)  # every caller is waiting on the read now
    first.cancel()  # a caller cancelled meanwhile does not cancel the others' read
    secrets = await asyncio.gather(*others)
    assert first.cancelled()
    assert store.reads == 1
    assert set(secrets) == {await signing_secret(OwnerStore(pool), "team-shared-read", keyring)}
    await cache.signing_secret("team-shared-read")
    assert store.reads == 1  # fresh: from the cache

    stale = OwnerCache(store, keyring, ttl_sec=0.0)
    await stale.signing_secret("team-shared-read")
    await stale.signing_secret("team-shared-read")
    assert store.reads == 3  # an entry past its time is read again


def claimed(task: dict, owner: str = "team-ready") -> ClaimedRun:
    now = datetime.now(UTC)
    return ClaimedRun(uuid.uuid4(), now, uuid.uuid4(), 1, uuid.uuid4(), now, "schedule", task, None, None, True, owner)


async def test_a_run_is_ready_without_a_read_only_when_prepare_would_read_nothing(pool: asyncpg.Pool) -> None:
    keyring = default_keyring()
    guard = TaskGuard(pool, keyring)
    sealed = {"type": "http", "url": "http://127.0.0.1:9/hook", "headers": {"X-Plain": "p"},
              "secretHeaders": {"Authorization": keyring.seal(SECRET)}}
    http_run, command_run = claimed(sealed), claimed({"type": "command", "command": ["true"]})
    assert guard.ready(http_run) is None  # the key is not checked yet

    await guard.start()
    assert guard.ready(http_run) is None  # the owner's signing secret was never read
    prepared = await guard.prepare(http_run)
    assert prepared.refusal is None and prepared.task is not None
    assert prepared.task["headers"] == {"X-Plain": "p", "Authorization": SECRET}
    assert guard.ready(http_run) == prepared  # fresh now: the same task, secret and signing secret
    assert guard.ready(claimed(sealed, owner="team-not-read")) is None
    assert guard.ready(command_run) is None  # its owner's permission is read by prepare
    assert (await guard.prepare(command_run)).refusal is not None

    unreadable = claimed({**sealed, "secretHeaders": {"Authorization": Keyring.generate().seal(SECRET)}})
    refused = guard.ready(unreadable)
    assert refused == await guard.prepare(unreadable)
    assert refused is not None and refused.task is None
    assert refused.refusal == ("cannot open task.secretHeaders.Authorization: it was sealed with another secret "
                               "key than this worker's")
