"""A role's homes run together: one home's node or worker failing stops the others and ends the role
with its error; a stop ends them all (chimes.cli.roles._run_together)."""

from __future__ import annotations

import asyncio

import pytest

from chimes.cli.roles import _run_together


class Home:
    def __init__(self, fails_after: float | None = None) -> None:
        self.stopping = asyncio.Event()
        self.fails_after = fails_after
        self.finished = False

    async def run(self) -> None:
        if self.fails_after is not None:
            await asyncio.sleep(self.fails_after)
            raise RuntimeError("the shard's node failed")
        await self.stopping.wait()
        self.finished = True


async def test_one_failing_home_stops_the_others_and_its_error_ends_the_role() -> None:
    healthy, failing = Home(), Home(fails_after=0.01)

    def stop() -> None:
        healthy.stopping.set()

    with pytest.raises(RuntimeError, match="the shard's node failed"):
        await asyncio.wait_for(_run_together([healthy.run(), failing.run()], stop), timeout=5)
    assert healthy.finished  # stopped the way a signal stops it, not cancelled


async def test_a_stop_ends_every_home() -> None:
    homes = [Home(), Home()]

    def stop() -> None:
        for home in homes:
            home.stopping.set()

    asyncio.get_running_loop().call_later(0.01, stop)
    await asyncio.wait_for(_run_together([home.run() for home in homes], stop), timeout=5)
    assert all(home.finished for home in homes)
