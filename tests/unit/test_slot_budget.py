"""A worker process's slots shared by its claim loops (chimes.worker.budget)."""

from __future__ import annotations

import asyncio

import pytest

from chimes.worker.budget import SlotBudget


async def test_reserved_slots_are_not_free_and_a_slot_given_back_wakes_every_loop() -> None:
    budget = SlotBudget(3)
    first, second = asyncio.Event(), asyncio.Event()
    budget.watch(first)
    budget.watch(second)
    budget.take(3)
    assert budget.free() == 0
    budget.give(0)  # a claim that got everything it reserved gives nothing back, and wakes no one
    assert not first.is_set() and not second.is_set()
    budget.give()
    assert budget.free() == 1 and first.is_set() and second.is_set()


def test_a_budget_has_a_slot_at_least() -> None:
    with pytest.raises(ValueError, match="at least one slot"):
        SlotBudget(0)


def test_the_batch_share_is_the_processs_across_its_claim_loops() -> None:
    budget = SlotBudget(10)
    assert budget.take_batch(cap=8, wanted=5) == 5  # one home's loop reserves for a claim
    assert budget.take_batch(cap=8, wanted=5) == 3  # another's gets what is left of the share
    assert budget.take_batch(cap=8, wanted=5) == 0
    budget.settle_batch(reserved=5, claimed=2)  # the first claim found two batch runs
    assert budget.batch_in_use == 5
    budget.settle_batch(reserved=3, claimed=4)  # a claim under a cap took one beyond: counted too
    assert budget.batch_in_use == 6
    budget.give_batch()
    assert budget.take_batch(cap=8, wanted=5) == 3
