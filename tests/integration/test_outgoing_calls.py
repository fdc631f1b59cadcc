"""Outgoing HTTP calls: every one is signed so that the target can verify it (with the example of
docs/security.md, run as written), and none reaches an address the egress policy denies, however
the address was reached: literally, by name, by redirect, or by a name that changes its answer."""

from __future__ import annotations

import ipaddress
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import httpx
import psutil
import pycurl
import pytest
from aiohttp import web

from chimes.security.secrets import default_keyring
from chimes.security.signing import SIGNATURE_HEADER
from chimes.security.ssrf import EgressDenied, EgressPolicy, GuardedConnector
from chimes.services.owners import signing_secret
from chimes.store.owners import OwnerStore
from chimes.worker.tasks.common import TaskContext
from chimes.worker.tasks.curl import CurlError, CurlPool
from chimes.worker.tasks.dispatch import Executors
from chimes.worker.tasks.http import HttpExecutor
from tests.helpers import Homes, http_server, wait_for
from tests.integration.fleet import Fleet, running_fleet
from tests.target import Target

SECURITY_DOC = Path(__file__).parents[2] / "docs" / "security.md"


def documented_verifier() -> Callable[[str, str, bytes], bool]:
    """The verification example of docs/security.md, exactly as a reader would copy it."""
    block = re.search(r"<!-- verify-example -->\s*```python\n(.*?)```", SECURITY_DOC.read_text(), re.DOTALL)
    assert block is not None, "docs/security.md lost its verification example"
    assert len(block.group(1).strip().splitlines()) <= 10, "the example should stay ten lines or fewer"
    namespace: dict[str, Any] = {}
    exec(block.group(1), namespace)
    return namespace["verify_chimes_signature"]


@dataclass
class VerifyingTarget:
    """A target that checks X-Chimes-Signature with the documented code: 200 if valid, else 401."""

    url: str
    secret: str = ""
    received: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    verdicts: list[bool] = field(default_factory=list)


@pytest.fixture
async def verifying_target() -> AsyncIterator[VerifyingTarget]:
    verify = documented_verifier()
    state = VerifyingTarget(url="")

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        state.received.append((dict(request.headers), body))
        valid = verify(state.secret, request.headers.get(SIGNATURE_HEADER, ""), body)
        state.verdicts.append(valid)
        return web.Response(status=200 if valid else 401, text="verified" if valid else "bad signature")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    yield state
    await runner.cleanup()


def one_off(name: str, task: dict[str, Any], attempts: int = 1) -> dict[str, Any]:
    at = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    return {"name": name, "schedule": {"at": at}, "task": task, "retryPolicy": {"maxAttempts": attempts}}


async def final_run(client: httpx.AsyncClient, job_id: str, timeout: float = 30) -> dict[str, Any]:
    async def ended() -> dict[str, Any] | None:
        runs = (await client.get(f"/jobs/{job_id}/runs")).json()["runs"]
        done = [r for r in runs if r["status"] in ("succeeded", "failed", "cancelled")]
        return (await client.get(f"/runs/{done[0]['runId']}")).json() if done else None

    run: dict[str, Any] = await wait_for(ended, timeout=timeout, what=f"a final run of job {job_id}")
    return run


async def test_every_call_is_signed_and_the_target_verifies_it(
    fleet: Fleet, client: httpx.AsyncClient, pool: asyncpg.Pool, verifying_target: VerifyingTarget
) -> None:
    verifying_target.secret = await signing_secret(OwnerStore(pool), "team-a", default_keyring())
    jobs = [
        one_off("json body", {"type": "http", "method": "POST", "url": f"{verifying_target.url}/a",
                              "body": {"report": "full", "ünïcode": "✓"}}),
        one_off("text body", {"type": "http", "method": "PUT", "url": f"{verifying_target.url}/b", "body": "plain"}),
        one_off("no body", {"type": "http", "method": "GET", "url": f"{verifying_target.url}/c"}),
    ]
    job_ids = [(await client.post("/jobs", json=job)).json()["jobId"] for job in jobs]
    runs = [await final_run(client, job_id) for job_id in job_ids]
    assert [r["status"] for r in runs] == ["succeeded"] * 3, runs
    assert verifying_target.verdicts == [True, True, True]
    assert all(SIGNATURE_HEADER in headers for headers, _ in verifying_target.received)


async def test_the_target_rejects_a_tampered_call(
    fleet: Fleet, client: httpx.AsyncClient, pool: asyncpg.Pool, verifying_target: VerifyingTarget
) -> None:
    verifying_target.secret = await signing_secret(OwnerStore(pool), "team-a", default_keyring())
    job = one_off("signed", {"type": "http", "url": f"{verifying_target.url}/pay", "body": {"amount": 10}})
    job_id = (await client.post("/jobs", json=job)).json()["jobId"]
    assert (await final_run(client, job_id))["status"] == "succeeded"
    headers, body = verifying_target.received[0]
    signature = headers[SIGNATURE_HEADER]
    timestamp = int(dict(p.split("=", 1) for p in signature.split(","))["t"])
    other_secret = await signing_secret(OwnerStore(pool), "team-b", default_keyring())
    verify = documented_verifier()
    secret = verifying_target.secret
    assert verify(secret, signature, body)
    assert not verify(secret, signature, body.replace(b"10", b"99")), "a changed body"
    assert not verify(secret, signature.replace(f"t={timestamp}", f"t={timestamp + 1}"), body), "a changed time"
    assert not verify(other_secret, signature, body), "another team's secret"
    assert not verify(secret, "", body), "no signature"
    stale = signature.replace(f"t={timestamp}", f"t={timestamp - 3600}")
    assert not verify(secret, stale, body), "an old timestamp (a replay)"
    # And over the wire: the same target answers 401 to the tampered request.
    async with httpx.AsyncClient() as http:
        tampered = await http.post(f"{verifying_target.url}/pay", content=body.replace(b"10", b"99"),
                                   headers={SIGNATURE_HEADER: signature})
    assert tampered.status_code == 401


async def test_a_task_cannot_forge_or_drop_the_signature(
    fleet: Fleet, client: httpx.AsyncClient, pool: asyncpg.Pool, homes: Homes, verifying_target: VerifyingTarget
) -> None:
    """The API refuses the header (422); one in a row written around the API is not sent either."""
    verifying_target.secret = await signing_secret(OwnerStore(pool), "team-a", default_keyring())
    task = {"type": "http", "url": f"{verifying_target.url}/f"}
    refused = await client.post("/jobs", json=one_off("forged", task | {"headers": {"x-chimes-signature": "t=1"}}))
    assert refused.status_code == 422 and refused.json()["field"] == "task.headers"
    job = one_off("forged", task)
    job["schedule"]["at"] = (datetime.now(UTC) + timedelta(seconds=2)).isoformat()
    job_id = (await client.post("/jobs", json=job)).json()["jobId"]
    await (await homes.for_job(job_id)).execute(
        """UPDATE jobs SET task = task || '{"headers": {"x-chimes-signature": "t=1,v1=00"}}' WHERE job_id = $1""",
        uuid.UUID(job_id))
    assert (await final_run(client, job_id))["status"] == "succeeded"
    headers, _ = verifying_target.received[0]
    assert headers[SIGNATURE_HEADER] != "t=1,v1=00"


async def test_rotating_the_signing_secret_changes_what_targets_must_check(pool: asyncpg.Pool) -> None:
    owners, keyring = OwnerStore(pool), default_keyring()
    first = await signing_secret(owners, "team-a", keyring)
    assert await signing_secret(owners, "team-a", keyring) == first
    rotated = await signing_secret(owners, "team-a", keyring, rotate=True)
    assert rotated != first and rotated.startswith("whsec_")
    stored = await pool.fetchval("SELECT signing_secret FROM owners WHERE owner = 'team-a'")
    assert rotated not in stored, "stored sealed, not in clear"


# --- egress (SSRF) -------------------------------------------------------------------------------

@pytest.fixture
async def guarded_fleet(pool: asyncpg.Pool, database_url: str, homes: Homes) -> AsyncIterator[None]:
    """A fleet that may not call 127.0.0.2 or anything named *.invalid, on top of the defaults: its
    worker (task calls) and its node (failure webhooks)."""
    policy = EgressPolicy.build(deny=["127.0.0.2/32", "*.invalid"])
    async with running_fleet(pool, database_url, homes, egress=policy, executors=lambda: Executors(egress=policy)):
        yield


@pytest.fixture
async def denied_target() -> AsyncIterator[Target]:
    """A target listening on 127.0.0.2, an address the guarded worker denies: it must never be called."""
    state = Target(url="")

    async def handle(request: web.Request) -> web.Response:
        state.calls.append(request)  # type: ignore[arg-type]
        return web.Response(text="should never be reached")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.2", 0)
    await site.start()
    state.url = f"http://127.0.0.2:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    yield state
    await runner.cleanup()


async def test_a_task_pointed_at_a_denied_address_fails_clearly_and_never_connects(
    guarded_fleet: None, client: httpx.AsyncClient, denied_target: Target
) -> None:
    job_id = (await client.post("/jobs", json=one_off("ssrf", {"type": "http", "url": f"{denied_target.url}/x"},
                                                      attempts=2))).json()["jobId"]
    run = await final_run(client, job_id)
    assert run["status"] == "failed"
    assert [a["error"] for a in run["attempts"]] == [
        "refused by egress policy: address 127.0.0.2 is in the denied network 127.0.0.2/32"] * 2
    assert denied_target.calls == []


async def test_a_failure_webhook_to_a_denied_address_is_refused_and_never_connects(
    guarded_fleet: None, client: httpx.AsyncClient, target: Target, denied_target: Target, homes: Homes
) -> None:
    target.responders["/broken"] = lambda n: 500
    job = one_off("alerting", {"type": "http", "url": f"{target.url}/broken"}, attempts=1)
    job_id = (await client.post("/jobs", json=job | {"notifyUrl": f"{denied_target.url}/hook"})).json()["jobId"]
    assert (await final_run(client, job_id))["status"] == "failed"
    pool = await homes.for_job(job_id)  # the job's notifications' database
    error = await wait_for(lambda: pool.fetchval("SELECT last_error FROM notifications"), timeout=20,
                           what="the webhook's first try")
    assert error == "refused by egress policy: address 127.0.0.2 is in the denied network 127.0.0.2/32"
    assert await pool.fetchval("SELECT sent_at FROM notifications") is None
    assert denied_target.calls == []


async def test_a_redirect_to_a_denied_address_is_not_followed(
    guarded_fleet: None, client: httpx.AsyncClient, target: Target, denied_target: Target
) -> None:
    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound(f"{denied_target.url}/metadata")

    app = web.Application()
    app.router.add_get("/go", redirect)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        task = {"type": "http", "method": "GET", "url": f"http://127.0.0.1:{port}/go"}
        run = await final_run(client, (await client.post("/jobs", json=one_off("hop", task))).json()["jobId"])
    finally:
        await runner.cleanup()
    assert run["status"] == "failed"
    assert run["error"] == "refused by egress policy: address 127.0.0.2 is in the denied network 127.0.0.2/32"
    assert denied_target.calls == []


async def test_a_denied_host_name_is_refused_before_it_is_even_resolved(
    guarded_fleet: None, client: httpx.AsyncClient
) -> None:
    task = {"type": "http", "url": "http://metadata.example.invalid/latest"}
    run = await final_run(client, (await client.post("/jobs", json=one_off("name", task))).json()["jobId"])
    assert run["error"] == "refused by egress policy: host metadata.example.invalid is denied (*.invalid)"


class FlippingResolver(aiohttp.abc.AbstractResolver):
    """A stand-in for a hostile DNS server (none can run here): it answers an allowed address first,
    then a denied one, as a DNS rebinding attack does."""

    def __init__(self, answers: list[str]) -> None:
        self.answers = answers

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list[dict[str, Any]]:
        address = self.answers.pop(0)
        return [{"hostname": host, "host": address, "port": port, "family": socket.AF_INET, "proto": 0,
                 "flags": socket.AI_NUMERICHOST}]

    async def close(self) -> None:
        pass


async def test_dns_rebinding_is_caught_at_connect_time(target: Target, denied_target: Target) -> None:
    policy = EgressPolicy.build(deny=["127.0.0.2/32"])
    target_port = int(target.url.rsplit(":", 1)[1])
    denied_port = int(denied_target.url.rsplit(":", 1)[1])
    resolver = FlippingResolver(["127.0.0.1", "127.0.0.2"])
    connector = GuardedConnector(policy, resolver=resolver, use_dns_cache=False, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        async with session.get(f"http://rebind.test:{target_port}/first") as first:
            assert first.status == 200
        with pytest.raises(aiohttp.ClientConnectorError) as refused:
            async with session.get(f"http://rebind.test:{denied_port}/second"):
                pass
    assert isinstance(refused.value.os_error, EgressDenied)
    assert [c.path for c in target.calls] == ["/first"]
    assert denied_target.calls == []


async def test_dns_rebinding_is_caught_at_connect_time_by_the_http_tasks_client(
    target: Target, denied_target: Target
) -> None:
    """The same, for HTTP tasks' client: libcurl's answers for the name are swapped between two calls
    (``CURLOPT_RESOLVE``, standing in for the hostile DNS server), and the second call's address is
    refused when its socket is opened."""
    pool = CurlPool(EgressPolicy.build(deny=["127.0.0.2/32"]), max_connections=1)
    try:
        for address, url in [("127.0.0.1", target.url), ("127.0.0.2", denied_target.url)]:
            port = int(url.rsplit(":", 1)[1])
            transfer = pool.transfer("rebind.test", lambda chunk: True)
            transfer.curl.setopt(pycurl.RESOLVE, [f"rebind.test:{port}:{address}"])
            transfer.curl.setopt(pycurl.URL, f"http://rebind.test:{port}/call")
            transfer.curl.setopt(pycurl.HTTPGET, 1)
            if address == "127.0.0.1":
                assert (await pool.perform(transfer)).status == 200
                continue
            with pytest.raises(CurlError) as refused:
                await pool.perform(transfer)
    finally:
        pool.close()
    assert refused.value.refusals == ("address 127.0.0.2 is in the denied network 127.0.0.2/32",)
    assert [c.path for c in target.calls] == ["/call"]
    assert denied_target.calls == []


METADATA_URLS = [
    ("http://169.254.169.254/latest/meta-data/", "address 169.254.169.254 is in the denied network 169.254.0.0/16"),
    ("http://[fd00:ec2::254]/latest/meta-data/", "address fd00:ec2::254 is in the denied network fd00:ec2::254/128"),
    ("http://[::ffff:169.254.169.254]/", "address ::ffff:a9fe:a9fe is in the denied network 169.254.0.0/16"),
    ("http://[::ffff:0:a9fe:a9fe]/", "address ::ffff:0:a9fe:a9fe is in the denied network 169.254.0.0/16"),
    ("http://[2002:a9fe:a9fe::1]/", "address 2002:a9fe:a9fe::1 is in the denied network 169.254.0.0/16"),
    ("http://[64:ff9b::a9fe:a9fe]/", "address 64:ff9b::a9fe:a9fe is in the denied network 169.254.0.0/16"),
    ("http://100.100.100.200/latest/meta-data/", "address 100.100.100.200 is in the denied network "
                                                 "100.100.100.200/32"),
    ("http://[fe80::1]/", "address fe80::1 is in the denied network fe80::/10"),
]


@pytest.mark.parametrize(("url", "reason"), METADATA_URLS, ids=[u for u, _ in METADATA_URLS])
async def test_metadata_and_link_local_addresses_are_denied_by_default(url: str, reason: str) -> None:
    """The refusal comes before any socket exists, so these tests send nothing anywhere."""
    executor = HttpExecutor()
    ctx = TaskContext("run", "job", 1, datetime.now(UTC), 5.0)
    started = time.monotonic()
    try:
        outcome = await executor.run({"type": "http", "method": "GET", "url": url}, ctx)
    finally:
        await executor.close()
    assert not outcome.succeeded
    assert outcome.error == f"refused by egress policy: {reason}"
    assert time.monotonic() - started < 2, "refused at once, not after a connect timeout"


def own_address() -> str | None:
    """An IPv4 address of this host's own that is not loopback (its LAN address), if it has one."""
    for name, addresses in psutil.net_if_addrs().items():
        stats = psutil.net_if_stats().get(name)
        for address in addresses:
            if (address.family == socket.AF_INET and stats is not None and stats.isup
                    and not ipaddress.ip_address(address.address).is_loopback):
                return str(address.address)
    return None


async def test_with_loopback_denied_a_service_on_every_address_is_reached_through_the_hosts_own_until_denied(
) -> None:
    """What docs/security.md says: denying loopback does not deny the host. A service listening on
    0.0.0.0 answers on the host's other addresses too, which are not loopback and which only the
    operator knows; --egress-deny with them is what keeps tasks off it."""
    address = own_address()
    if address is None:
        pytest.skip("this host has no address but loopback: there is nothing to reach it through")

    async def handle(request: web.Request) -> web.Response:
        return web.Response(text="the host's own service")

    ctx = TaskContext("run", "job", 1, datetime.now(UTC), 5.0)
    async with http_server(handle, host="0.0.0.0") as listening:
        url = f"http://{address}:{listening.rsplit(':', 1)[1]}/"
        outcomes = []
        for policy in (EgressPolicy.build(allow_loopback=False),
                       EgressPolicy.build(allow_loopback=False, deny=[f"{address}/32"])):
            executor = HttpExecutor(egress=policy)
            try:
                outcomes.append(await executor.run({"type": "http", "method": "GET", "url": url}, ctx))
            finally:
                await executor.close()
    reached, denied = outcomes
    assert reached.succeeded, reached.error
    assert not denied.succeeded
    assert denied.error == f"refused by egress policy: address {address} is in the denied network {address}/32"


@pytest.fixture
async def name_guarded_fleet(pool: asyncpg.Pool, database_url: str, homes: Homes) -> AsyncIterator[None]:
    """A fleet that may not call the names ``localhost`` and ``*.localhost``, though it may call the
    address they resolve to, 127.0.0.1: only the name rules stand between a task and these names.
    The names are refused before they are looked up, so nothing here asks a DNS server."""
    policy = EgressPolicy.build(deny=["localhost", "*.localhost"])
    async with running_fleet(pool, database_url, homes, egress=policy, executors=lambda: Executors(egress=policy)):
        yield


ENCODED_HOSTS = [
    ("%6cocalhost", "host localhost is denied (localhost)"),
    ("LOCALHOST.", "host localhost is denied (localhost)"),
    ("foo.%6cocalhost", "host foo.localhost is denied (*.localhost)"),
    ("%66%6F%6F.localhost.", "host foo.localhost is denied (*.localhost)"),
]


async def test_host_name_rules_judge_the_name_the_client_resolves_not_its_spelling(
    name_guarded_fleet: None, client: httpx.AsyncClient, target: Target, homes: Homes
) -> None:
    """A URL's host is percent-decoded before it is resolved: ``http://%6cocalhost/`` calls localhost. A rule that
    compared the host as written let such a task through to a denied name, and its webhook too."""
    port = int(target.url.rsplit(":", 1)[1])
    target.responders["/broken"] = lambda n: 500
    allowed = one_off("by address", {"type": "http", "method": "GET", "url": f"http://127.0.0.1:{port}/allowed"})
    assert (await final_run(client, (await client.post("/jobs", json=allowed)).json()["jobId"]))["status"] == \
        "succeeded", "the address itself is allowed: only the name is denied"
    for host, reason in ENCODED_HOSTS:
        task = {"type": "http", "method": "GET", "url": f"http://{host}:{port}/denied"}
        created = await client.post("/jobs", json=one_off(host, task))
        assert created.status_code == 201, created.text
        run = await final_run(client, created.json()["jobId"])
        assert (run["status"], run["error"]) == ("failed", f"refused by egress policy: {reason}"), host

    hook = one_off("alerting", {"type": "http", "url": f"{target.url}/broken"})
    job_id = (await client.post("/jobs", json=hook | {"notifyUrl": f"http://%6cocalhost:{port}/hook"})).json()["jobId"]
    assert (await final_run(client, job_id))["status"] == "failed"
    notifications = await homes.for_job(job_id)
    error = await wait_for(lambda: notifications.fetchval("SELECT last_error FROM notifications"), timeout=20,
                           what="the webhook's first try")
    assert error == "refused by egress policy: host localhost is denied (localhost)"
    assert [c.path for c in target.calls] == ["/allowed", "/broken"], "no denied name was ever called"
