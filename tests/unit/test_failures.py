"""Narrowing a failed batch down to the items that fail it alone (chimes.failures)."""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg
import pytest

from chimes.failures import describe, is_transient, narrow_down


async def test_one_bad_item_is_set_aside_and_the_rest_goes_through() -> None:
    done: list[list[int]] = []
    poisoned: list[int] = []

    async def step(items: Sequence[int]) -> int:
        if 7 in items:
            raise ValueError("item 7 cannot be stored")
        done.append(list(items))
        return len(items)

    results = await narrow_down(list(range(20)), step, lambda item, exc: poisoned.append(item))
    assert poisoned == [7]
    assert sorted(i for batch in done for i in batch) == [i for i in range(20) if i != 7]
    assert sum(results) == 19
    assert len(done) <= 2 * 5  # about two calls per halving, not one per item


async def test_a_transient_error_fails_the_whole_batch_for_a_later_try() -> None:
    async def step(items: Sequence[int]) -> int:
        raise asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation")

    with pytest.raises(asyncpg.ConnectionDoesNotExistError):
        await narrow_down([1, 2, 3], step, lambda item, exc: pytest.fail("nothing is set aside"))


def test_errors_of_the_data_are_not_transient() -> None:
    assert is_transient(TimeoutError())
    assert is_transient(asyncpg.AdminShutdownError("terminating connection due to administrator command"))
    assert not is_transient(asyncpg.CharacterNotInRepertoireError('invalid byte sequence for encoding "UTF8": 0x00'))
    assert not is_transient(asyncpg.exceptions._base.DataError("invalid input for query argument $1"))
    assert not is_transient(RuntimeError("a bug"))


def test_a_cause_is_never_empty() -> None:
    assert describe(TimeoutError()) == "TimeoutError"
    assert describe(OSError("Connection refused")) == "OSError: Connection refused"


async def test_an_error_every_part_meets_is_no_bad_item() -> None:
    async def step(items: Sequence[int]) -> int:
        raise asyncpg.UndefinedColumnError('column "job_version" does not exist')

    with pytest.raises(asyncpg.UndefinedColumnError):
        await narrow_down([1, 2, 3, 4], step, lambda item, exc: pytest.fail("nothing is set aside"))
