"""Sends queued notifications (a run failed for good) to their webhooks, at least once each.

Rows are written to the ``notifications`` outbox in the same transaction as the failure, so none is
lost. A sender claims a batch by pushing its next attempt a lease ahead, posts each one with its id
as ``Idempotency-Key``, and marks it sent. A sender killed between posting and marking leaves the
row to be sent again after the lease, with the same key, for the receiver to deduplicate.

Scheduler nodes send them, so they go out even when no worker is alive. A webhook is a call a team
chose, like a task's, so it goes out under the operator's egress policy and is signed with the
owner's signing secret exactly as task calls are.

Redirects are followed here, not by aiohttp, which would carry the signature to whatever origin the
receiver names: a redirect within the webhook's origin (scheme, host and port) is followed, with the
same body and signature, for at most 10 hops; one to another origin is not followed and fails the
delivery, saying so.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from yarl import URL

from chimes import __version__, failures
from chimes.security.secrets import SecretKeyError
from chimes.security.signing import SIGNATURE_HEADER, signature_header
from chimes.security.ssrf import EgressPolicy, GuardedConnector, egress_error, outgoing_url
from chimes.settings import NOTIFY_GIVE_UP_HOURS
from chimes.store.db import DB_ERRORS, Pool
from chimes.store.notifications import ClaimedNotification, Outbox

log = logging.getLogger(__name__)

MAX_REDIRECTS = 10
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})


@dataclass(frozen=True, slots=True)
class NotifierConfig:
    batch: int = 100
    lease_sec: float = 60.0  # a claimed notification not marked within this is sent again
    timeout_sec: float = 10.0
    max_backoff_sec: float = 3600.0
    give_up_after_sec: float = NOTIFY_GIVE_UP_HOURS * 3600  # undelivered this long after it was queued: dead-lettered
    egress: EgressPolicy | None = None  # None: the default policy (metadata and link-local denied)


SecretOfOwner = Callable[[str], Awaitable[str]]  # owner -> signing secret in clear (store.owners.SigningSecrets)


class Notifier:
    def __init__(self, pool: Pool, signing_secret: SecretOfOwner,
                 config: NotifierConfig | None = None) -> None:
        self._outbox = Outbox(pool)
        self._signing_secret = signing_secret
        self.config = config or NotifierConfig()
        self._session: aiohttp.ClientSession | None = None
        self.sent = 0

    async def deliver_due(self) -> int:
        """Send what is due now; returns how many were delivered."""
        claimed = await self._outbox.claim(self.config.batch, self.config.lease_sec)
        if not claimed:
            return 0
        results = [_error_text(result) for result in await asyncio.gather(
            *(self._post(n.notification_id, n.owner, n.url, n.payload) for n in claimed),
            return_exceptions=True)]
        delivered = [n.notification_id for n, error in zip(claimed, results, strict=True) if error is None]
        failed = [(n, error) for n, error in zip(claimed, results, strict=True) if error is not None]
        if delivered:
            await self._outbox.mark_sent(delivered)
        if failed:
            await self._retry_or_give_up(failed)
            for n, error in failed:
                log.warning("notification %s to %s failed (attempt %d): %s", n.notification_id, n.url,
                            n.attempts, error)
        self.sent += len(delivered)
        return len(delivered)

    async def _retry_or_give_up(self, failed: list[tuple[ClaimedNotification, str]]) -> None:
        """Back off each failed notification, or dead-letter it past the give-up time."""
        dead = await self._outbox.retry(
            [n.notification_id for n, _ in failed],
            [min(self.config.max_backoff_sec, 2.0 ** n.attempts) for n, _ in failed],
            [error for _, error in failed], self.config.give_up_after_sec,
        )
        for notification_id in dead:
            log.warning("notification %s dead-lettered: undelivered %gs after it was queued",
                        notification_id, self.config.give_up_after_sec)

    async def _post(self, notification_id: uuid.UUID, owner: str, url: str, payload: Any) -> str | None:
        body = orjson.dumps(payload)
        try:
            secret = await self._signing_secret(owner)
        except (SecretKeyError, *DB_ERRORS) as exc:  # recorded on the row and retried; never sent unsigned
            return f"cannot sign: {type(exc).__name__}: {exc}"[:500]
        headers = {"Content-Type": "application/json", "Idempotency-Key": str(notification_id),
                   "User-Agent": f"chimes/{__version__}", "X-Chimes-Notification-Id": str(notification_id),
                   SIGNATURE_HEADER: signature_header(secret, int(time.time()), body)}
        try:  # the host as it will be resolved, which the egress policy judges (chimes.security.ssrf)
            target = outgoing_url(url)
        except ValueError as exc:  # refused by the API; a row written around it is recorded as failing
            return f"cannot call {url}: {exc}"[:500]
        try:
            return await self._post_following(target, body, headers)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            return (egress_error(exc) or f"{type(exc).__name__}: {exc}")[:500]

    async def _post_following(self, url: URL, body: bytes, headers: dict[str, str]) -> str | None:
        """POST, following redirects within ``url``'s origin only; None when delivered, else why not."""
        for _ in range(MAX_REDIRECTS + 1):
            async with self._session_now().post(url, data=body, headers=headers, allow_redirects=False) as response:
                await response.read()
                status = response.status
                location = response.headers.get("Location") if status in _REDIRECT_STATUSES else None
            if location is None:
                return None if 200 <= status < 300 else f"HTTP {status}"
            following = url.join(URL(location))
            if following.scheme in ("http", "https"):
                following = outgoing_url(str(following))
            if following.scheme not in ("http", "https") or following.origin() != url.origin():
                return (f"HTTP {status}: redirect to {following} not followed: a webhook goes to the origin it "
                        "names, with its signature")[:500]
            url = following
        return f"more than {MAX_REDIRECTS} redirects"

    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=self.config.timeout_sec)
            # Webhooks are chosen by teams: the same egress policy as their tasks keeps them off
            # link-local and cloud metadata addresses.
            connector = GuardedConnector(self.config.egress or EgressPolicy.build())
            self._session = aiohttp.ClientSession(timeout=timeout, connector=connector,
                                                  cookie_jar=aiohttp.DummyCookieJar())
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _error_text(result: str | BaseException | None) -> str | None:
    """A notification whose sending failed unexpectedly is retried like one its target refused,
    and the others of its batch go out all the same."""
    if isinstance(result, asyncio.CancelledError):
        raise result
    if isinstance(result, BaseException):
        log.error("sending a notification failed: %s", failures.describe(result), exc_info=result)
        return f"internal error: {failures.describe(result)}"[:500]
    return result
