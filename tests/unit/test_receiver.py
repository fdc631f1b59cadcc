"""The receiver SDK's pure parts: verification results and the deduplication states."""

from __future__ import annotations

import pytest

from chimes.receiver import CallRejected, MemoryIdempotencyStore, Receiver, Seen, verify_call
from chimes.security.signing import SIGNATURE_HEADER, signature_header

NOW = 1_800_000_000
HEADERS = {"X-Chimes-Run-Id": "r1", "X-Chimes-Job-Id": "j1", "X-Chimes-Attempt": "2",
           "X-Chimes-Scheduled-At": "2026-12-01T09:00:00Z", "Idempotency-Key": "r1"}


def signed(secret: str, body: bytes, at: int = NOW, **extra: str) -> dict[str, str]:
    return HEADERS | {SIGNATURE_HEADER: signature_header(secret, at, body)} | extra


def test_a_call_is_verified_with_any_of_the_secrets_being_rotated() -> None:
    call = verify_call(signed("whsec_new", b"{}"), b"{}", ["whsec_old", "whsec_new"], clock=lambda: NOW + 10)
    assert (call.run_id, call.attempt, call.scheduled_at.isoformat()) == ("r1", 2, "2026-12-01T09:00:00+00:00")
    assert call.lease_token is None and call.traceparent is None


@pytest.mark.parametrize(("headers", "status", "reason"), [
    (signed("whsec_other", b"{}"), 401, "does not match"),
    (signed("whsec_s", b"{}", at=NOW - 301), 401, "301 s ago"),
    (signed("whsec_s", b"{}", at=NOW + 301), 401, "301 s ahead"),
    ({k: v for k, v in signed("whsec_s", b"{}").items() if k != "X-Chimes-Run-Id"}, 400, "X-Chimes-Run-Id"),
    (signed("whsec_s", b"{}", **{"X-Chimes-Attempt": "two"}), 400, "malformed"),
])
def test_refusals_say_why(headers: dict[str, str], status: int, reason: str) -> None:
    with pytest.raises(CallRejected) as refused:
        verify_call(headers, b"{}", "whsec_s", clock=lambda: NOW)
    assert refused.value.status == status and reason in refused.value.reason


async def test_the_store_forgets_failures_and_remembers_successes_for_their_ttl() -> None:
    now = [0.0]
    store = MemoryIdempotencyStore(clock=lambda: now[0])
    assert await store.begin("a", 60) is Seen.FIRST
    assert await store.begin("a", 60) is Seen.RUNNING and Seen.RUNNING.status == 409
    await store.finish("a", False, 60)
    assert await store.begin("a", 60) is Seen.FIRST  # a failed attempt is done again by the retry
    await store.finish("a", True, 60)
    assert await store.begin("a", 60) is Seen.DONE and Seen.DONE.status == 200
    now[0] = 61
    assert await store.begin("a", 60) is Seen.FIRST


async def test_deduplicate_finishes_the_key_by_how_the_block_ends() -> None:
    receiver = Receiver("whsec_s", clock=lambda: NOW)
    call = receiver.verify(signed("whsec_s", b""), b"")
    with pytest.raises(RuntimeError):
        async with receiver.deduplicate(call) as seen:
            assert seen is Seen.FIRST
            raise RuntimeError("work failed")
    async with receiver.deduplicate(call) as seen:
        assert seen is Seen.FIRST
    async with receiver.deduplicate(call) as seen:
        assert seen is Seen.DONE


def test_a_receiver_needs_a_secret() -> None:
    with pytest.raises(ValueError, match="signing secret"):
        Receiver([])
