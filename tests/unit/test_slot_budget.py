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
