"""The receiver: what a target's app holds to check, deduplicate and report Chimes' calls.

One object per app, shared by its handlers. The framework adapters turn a request into the headers
and raw body :meth:`Receiver.verify` needs; everything else is the same for every framework, async
only (the callbacks are HTTP calls; a sync app has no 202 flow to run).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager

from chimes.receiver.callbacks import MAX_ERROR_CHARS, MAX_OUTPUT_CHARS, LeaseLost, RunReporter
from chimes.receiver.calls import ChimesCall, verify_call
from chimes.receiver.dedupe import DEFAULT_TTL_SEC, IdempotencyStore, MemoryIdempotencyStore, Seen
from chimes.security.signing import DEFAULT_TOLERANCE_SEC
from chimes.security.storable import storable_text

__all__ = ["Receiver", "Work"]

log = logging.getLogger("chimes.receiver")

#: Long work: called with the call, returns the output to record (or None); raising fails the attempt.
Work = Callable[[ChimesCall], Awaitable[str | None]]

#: A heartbeat extends the lease by 30 s (docs/semantics.md): a third of that leaves room for two misses.
DEFAULT_HEARTBEAT_SEC = 10.0


class Receiver:
    """Checks calls with the owner's signing secret (or several, while rotating), deduplicates them
    in ``store`` (this process's memory by default) and, given the API's URL and an owner's token,
    runs long work in the background and reports it through the callbacks."""

    def __init__(self, secret: str | Iterable[str], *, api_url: str | None = None, token: str | None = None,
                 store: IdempotencyStore | None = None, tolerance_sec: float = DEFAULT_TOLERANCE_SEC,
                 dedupe_ttl_sec: float = DEFAULT_TTL_SEC, heartbeat_every_sec: float = DEFAULT_HEARTBEAT_SEC,
                 reporter: RunReporter | None = None, clock: Callable[[], float] = time.time) -> None:
        self._secrets = [secret] if isinstance(secret, str) else list(secret)
        if not self._secrets or not all(self._secrets):
            raise ValueError("a signing secret is needed (chimes owner signing-secret TEAM prints it)")
        self.store: IdempotencyStore = store or MemoryIdempotencyStore()
        self.tolerance_sec = tolerance_sec
        self.dedupe_ttl_sec = dedupe_ttl_sec
        self.heartbeat_every_sec = heartbeat_every_sec
        if reporter is None and api_url is not None and token is not None:
            reporter = RunReporter(api_url, token)
        self.reporter = reporter
        self._clock = clock
        self._background: set[asyncio.Task[None]] = set()

    def verify(self, headers: Mapping[str, str], body: bytes) -> ChimesCall:
        """The verified call; raises :class:`~chimes.receiver.calls.CallRejected` (401 or 400)."""
        return verify_call(headers, body, self._secrets, tolerance_sec=self.tolerance_sec, clock=self._clock)

    @asynccontextmanager
    async def deduplicate(self, call: ChimesCall) -> AsyncIterator[Seen]:
        """Claim the call's key for the block. Do the work only when it yields ``Seen.FIRST``; else
        answer ``seen.status`` (200 done, 409 still running). The key is done when the block ends
        normally and forgotten when it raises, so that Chimes' retry does the work again."""
        seen = await self.store.begin(call.idempotency_key, self.dedupe_ttl_sec)
        if seen is not Seen.FIRST:
            log.info("run %s (attempt %d) is a duplicate: %s", call.run_id, call.attempt, seen.value,
                     extra={"run_id": call.run_id})
            yield seen
            return
        try:
            yield seen
        except BaseException:
            await self.store.finish(call.idempotency_key, False, self.dedupe_ttl_sec)
            raise
        await self.store.finish(call.idempotency_key, True, self.dedupe_ttl_sec)

    async def accept(self, call: ChimesCall, work: Work) -> int:
        """Start ``work`` in the background, heartbeating and completing the run, unless the call is a
        duplicate; returns the status to answer: 202 (accepted), 200 (already done) or 409 (running).

        The job's task needs ``"callback": true``, or Chimes takes the 202 for a plain success.
        """
        if self.reporter is None:
            raise ValueError("accept() reports through the API: give the Receiver api_url and token")
        if call.lease_token is None:
            raise ValueError(f"run {call.run_id}: the call carries no X-Chimes-Lease-Token to report with")
        seen = await self.store.begin(call.idempotency_key, self.dedupe_ttl_sec)
        if seen is not Seen.FIRST:
            return seen.status
        task = asyncio.create_task(self._work_and_report(call, work, self.reporter, call.lease_token))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return 202

    async def _work_and_report(self, call: ChimesCall, work: Work, reporter: RunReporter, lease: str) -> None:
        heartbeats = asyncio.create_task(self._heartbeat(call, reporter, lease))
        error: str | None = None
        output: str | None = None
        try:
            output = await work(call)
        except asyncio.CancelledError:  # the app stops: the run is reaped and retried elsewhere
            await self.store.finish(call.idempotency_key, False, self.dedupe_ttl_sec)
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            heartbeats.cancel()
        # The store says whether the work was done, whatever the report's fate: a retry of a run whose
        # completion got lost is then answered 200 instead of doing the work twice.
        await self.store.finish(call.idempotency_key, error is None, self.dedupe_ttl_sec)
        try:
            await reporter.complete(call.run_id, lease, "failed" if error else "succeeded",
                                    error=_reportable(error, MAX_ERROR_CHARS),
                                    output=_reportable(output, MAX_OUTPUT_CHARS))
        except LeaseLost:
            log.warning("run %s was no longer ours to complete (reaped or cancelled)", call.run_id,
                        extra={"run_id": call.run_id})
        except Exception as exc:  # CallbackError, or the API unreachable after the tries
            log.error("completing run %s failed: %s; the reaper will retry it", call.run_id, exc,
                      extra={"run_id": call.run_id})

    async def _heartbeat(self, call: ChimesCall, reporter: RunReporter, lease: str) -> None:
        while True:
            try:
                await reporter.heartbeat(call.run_id, lease)
            except LeaseLost:
                log.warning("run %s was taken away (reaped or cancelled); its work goes on unreported",
                            call.run_id, extra={"run_id": call.run_id})
                return
            except Exception as exc:  # a missed heartbeat is not fatal: the lease outlasts two
                log.warning("heartbeat of run %s failed: %s", call.run_id, exc, extra={"run_id": call.run_id})
            await asyncio.sleep(self.heartbeat_every_sec)

    async def aclose(self) -> None:
        """Stop background work (its runs are reaped and retried) and close the API client."""
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.reporter is not None:
            await self.reporter.aclose()


def _reportable(text: str | None, most: int) -> str | None:
    """The work's own text as the API takes it: a NUL or a lone surrogate replaced, the rest cut at
    ``most`` characters. What the API would refuse (422) would leave the attempt unreported, and the
    reaper would have the work done again."""
    stored = storable_text(text)
    return None if stored is None else stored[:most]
