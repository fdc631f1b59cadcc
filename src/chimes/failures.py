"""What the long-lived loops of every role do with a failure: say its cause, count it, go on.

A scheduler node or a worker serves every team at once, so nothing one job can put in the database
may stop a loop: a step that fails is logged with its cause and counted, and the loop runs again.
A failure that one item causes (a trigger whose time cannot be computed, an outcome the database
refuses) is narrowed down to that item, which is set aside ("poison") while the rest goes on.

Failures of the connection or the server (a restart, a failover, a lost network) are transient: the
same work is simply tried again. Anything else may be caused by the data of one item.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from chimes import metrics, outage
from chimes.store.db import TRANSIENT_ERRORS
from chimes.store.db import describe as describe  # failures.describe, for the roles

log = logging.getLogger("chimes.failures")
T = TypeVar("T")
R = TypeVar("R")

def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` says nothing about the data: the same work may succeed when tried again."""
    return isinstance(exc, TRANSIENT_ERRORS) and not isinstance(exc, ValueError)


def loop_failed(role: str, loop: str, exc: BaseException) -> None:
    """Log and count a failed step of a long-lived loop, which then runs again."""
    metrics.LOOP_FAILURES.labels(role, loop).inc()
    if is_transient(exc):
        outage.failed(loop, describe(exc), outage.database_of(exc))  # logged once per outage, not once per step
    else:
        log.error("%s failed: %s", loop, describe(exc), exc_info=exc)


def set_aside(role: str, kind: str, what: str, exc: BaseException) -> None:
    """Log and count one item set aside because handling it failed."""
    metrics.ITEMS_SET_ASIDE.labels(role, kind).inc()
    log.error("%s set aside: %s", what, describe(exc), exc_info=exc)


async def narrow_down(items: Sequence[T], step: Callable[[Sequence[T]], Awaitable[R]],
                      on_poison: Callable[[T, Exception], None]) -> list[R]:
    """Run ``step`` on ``items``; when it fails for a reason other than a transient one, run it on
    each half in turn, down to single items, and hand the ones that fail alone to ``on_poison``.
    One bad item costs about 2·log2(n) extra calls; the rest of the batch still goes through.
    Returns the results of the calls that succeeded.

    Transient errors propagate: the caller tries the whole batch again later. So does an error that
    every part of a batch of several met: that is no bad item but something wrong with every call
    (a schema that does not match the code during an upgrade, say), and setting the whole batch
    aside would stop it for good."""
    poisoned: list[tuple[T, Exception]] = []
    results = await _narrow(items, step, poisoned)
    if poisoned and not results and len(items) > 1:
        raise poisoned[0][1]
    for item, exc in poisoned:
        on_poison(item, exc)
    return results


async def _narrow(items: Sequence[T], step: Callable[[Sequence[T]], Awaitable[R]],
                  poisoned: list[tuple[T, Exception]]) -> list[R]:
    if not items:
        return []
    try:
        return [await step(items)]
    except Exception as exc:
        if is_transient(exc):
            raise
        if len(items) == 1:
            poisoned.append((items[0], exc))
            return []
    middle = len(items) // 2
    return await _narrow(items[:middle], step, poisoned) + await _narrow(items[middle:], step, poisoned)
