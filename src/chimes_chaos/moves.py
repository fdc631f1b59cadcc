"""Partition moves during a chaos run (``--moves``): ranges of partitions sent back and forth between
homes through the real CLI (``python -m chimes shards move``), while the faults go on.

The plan is drawn from the seed up front, as the faults are: which range moves next, whether its mover
is left alone, SIGKILLed and resumed (``--resume``), or SIGKILLed and cancelled (``--cancel``), and
how long after its start the kill comes. Each range goes to the next home after the one holding it,
so with two homes it goes back and forth. A move command that fails (the catalog restarting under
it, a stopped shard past a timeout) leaves its move recorded in the catalog: it is resumed at once,
and again until it ends; when the faults are over every move under way is resumed before the checks
(:meth:`MoveRunner.finish`), so the run ends with none under way.

What happened to each move is kept as a :class:`MoveWindow` (from the command that began it to the
one that ended it): its range's runs count as waiting inside a fault while it was under way, and
the checks read each partition's leases on the home that held it at the time (the cut-over times
come from the catalog's ``shard_moves`` rows).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

from chimes_chaos.fleet import Fleet

log = logging.getLogger(__name__)

GAP_SEC = (1.0, 5.0)  # between the end of one move and the start of the next
KILL_AFTER_SEC = (0.0, 3.0)  # a killed mover dies this long after it recorded its move
COMMAND_TIMEOUT_SEC = 90.0  # a command still running after this long is killed (its move is resumed)
DRAIN_TIMEOUT_SEC = 20.0  # --drain-timeout: the range pauses at most this long for its runs in flight
RETRY_SEC = 1.0  # between tries to resume a move whose command failed
FINISH_WITHIN_SEC = 180.0  # after the faults: every move under way must have ended by then
# What happens to a move's mover, drawn with these weights.
ACTIONS = {"left_alone": 0.5, "killed_then_resumed": 0.3, "killed_then_cancelled": 0.2}


@dataclass(frozen=True, slots=True)
class PlannedMove:
    block: int  # which of the movable ranges
    action: str  # a key of ACTIONS
    kill_after: float  # seconds after the command starts (for the killed ones)
    gap: float  # seconds to wait before it starts


@dataclass(slots=True)
class MoveWindow:
    """One move as it happened: epoch seconds, from its first command's start to its last one's end."""

    first: int
    last: int
    source: int  # home index (0: the catalog)
    target: int
    action: str
    started: float
    ended: float | None = None
    move_id: int | None = None
    outcome: str = ""  # "done", "cancelled", or "" when no move was recorded (the mover died first)
    kills: int = 0
    resumes: int = 0
    cancels: int = 0
    failed_commands: int = 0
    cut_over_at: float | None = None  # from the catalog: when the range changed home

    def covers(self, partition: int) -> bool:
        return self.first <= partition <= self.last


def movable_blocks(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranges that move: the upper half of each home's first range (the lower halves stay, so
    every home keeps jobs of its own)."""
    return [((first + last + 1) // 2, last) for first, last in ranges]


def plan_moves(seed: int | str, count: int, blocks: int) -> list[PlannedMove]:
    rng = random.Random(f"{seed}-moves")
    actions, weights = list(ACTIONS), list(ACTIONS.values())
    return [PlannedMove(rng.randrange(blocks), rng.choices(actions, weights)[0],
                        round(rng.uniform(*KILL_AFTER_SEC), 2), round(rng.uniform(*GAP_SEC), 2))
            for _ in range(count)]


@dataclass
class MoveRunner:
    fleet: Fleet
    seed: int | str
    log_dir: Path
    windows: list[MoveWindow] = field(default_factory=list)
    commands: int = 0
    last_move_id: int | None = None  # the newest move recorded in the catalog that a window claimed

    def __post_init__(self) -> None:
        self.blocks = movable_blocks(self.fleet.ranges)
        self.homes_of_blocks = list(range(len(self.blocks)))  # block k starts on home k

    async def run(self, until: float) -> None:
        """Moves one after another until ``until`` (loop time); the one going on then is finished."""
        loop = asyncio.get_running_loop()
        for planned in plan_moves(self.seed, 10_000, len(self.blocks)):
            await asyncio.sleep(planned.gap)
            if loop.time() >= until:
                return
            await self._move(planned)

    async def finish(self) -> None:
        """After the faults: resume (or cancel) every move under way until none is (the checks need a
        map that stands still)."""
        deadline = time.monotonic() + FINISH_WITHIN_SEC
        while (phase := await self._phase_under_way()) is not None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"a move was still {phase} {FINISH_WITHIN_SEC:g} s after the faults")
            window = self.windows[-1] if self.windows else None
            if await self._command("--resume") != 0:
                await asyncio.sleep(RETRY_SEC)
            if window is not None:
                window.resumes += 1
        if self.windows and self.windows[-1].ended is None:
            self.windows[-1].ended = time.time()
        await self._read_outcomes()

    async def _move(self, planned: PlannedMove) -> None:
        first, last = self.blocks[planned.block]
        source = self.homes_of_blocks[planned.block]
        target = (source + 1) % len(self.fleet.home_dsns)
        window = MoveWindow(first, last, source, target, planned.action, time.time())
        self.windows.append(window)
        log.info("move: partitions %d-%d %s -> %s (%s)", first, last, self.fleet.home_names[source],
                 self.fleet.home_names[target], planned.action.replace("_", " "))
        kill_after = planned.kill_after if planned.action != "left_alone" else None
        code = await self._command(f"{first}-{last}", "--to", await self._to(target), kill_after=kill_after)
        if code == -signal.SIGKILL:
            window.kills += 1
        while (phase := await self._phase_under_way()) is not None:
            # Killed, or failed under a fault: cancelled if so planned (and still possible), else resumed.
            cancel = planned.action == "killed_then_cancelled" and phase in ("copying", "fenced")
            if code not in (0, -signal.SIGKILL):
                window.failed_commands += 1
            if cancel:
                window.cancels += 1
            else:
                window.resumes += 1
            code = await self._command("--cancel" if cancel else "--resume")
            if code != 0:
                await asyncio.sleep(RETRY_SEC)
        window.ended = time.time()
        outcome = await self._last_outcome()
        if outcome is None or outcome[0] == self.last_move_id:
            return  # the mover died before it recorded the move: nothing moved
        window.move_id, window.outcome = outcome
        self.last_move_id = outcome[0]
        if window.outcome == "done":
            self.homes_of_blocks[planned.block] = target

    async def _to(self, home: int) -> str:
        """``--to`` for a home: "catalog", or the shard's id (its URL would put a password in the log)."""
        if home == 0:
            return "catalog"
        rows = await self._fetch("SELECT shard_id FROM shards WHERE url = $1", self.fleet.home_dsns[home])
        return str(rows[0]["shard_id"])

    async def _command(self, *args: str, kill_after: float | None = None) -> int:
        """``python -m chimes shards move ARGS`` against the catalog; its exit code (negative: the
        signal that ended it)."""
        self.commands += 1
        log_path = self.log_dir / "moves.log"
        with log_path.open("ab") as out:
            out.write(f"--- {time.strftime('%H:%M:%S')} shards move {' '.join(args)}\n".encode())
            out.flush()
            start = out.tell()
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "chimes", "shards", "move", *args, "--drain-timeout", f"{DRAIN_TIMEOUT_SEC:g}",
                env=self.fleet.env | {"CHIMES_DATABASE_URL": self.fleet.dsn}, stdout=out, stderr=out,
                stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
            try:
                if kill_after is None:
                    await asyncio.wait_for(proc.wait(), timeout=COMMAND_TIMEOUT_SEC)
                else:
                    await self._until_recorded(proc, log_path, start)
                    await asyncio.wait_for(proc.wait(), timeout=kill_after)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
                out.write(b"--- killed\n")
            return proc.returncode if proc.returncode is not None else -signal.SIGKILL

    @staticmethod
    async def _until_recorded(proc: asyncio.subprocess.Process, log_path: Path, start: int) -> None:
        """Until the command has recorded its move (it prints its plan then) or has ended: a kill is
        timed from there, so that it lands in the move, not in the interpreter's start-up."""
        deadline = time.monotonic() + COMMAND_TIMEOUT_SEC
        while proc.returncode is None and time.monotonic() < deadline:
            with log_path.open("rb") as written:
                written.seek(start)
                if b"\npartitions " in b"\n" + written.read():
                    return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), timeout=0.05)

    async def _fetch(self, query: str, *args: object) -> list[asyncpg.Record]:
        """``query``'s rows from the catalog, tried again every second until it answers (it may be
        restarting, one of the faults)."""
        while True:
            try:
                conn = await asyncpg.connect(self.fleet.dsn, timeout=5)
                try:
                    return list(await conn.fetch(query, *args, timeout=5))
                finally:
                    await conn.close()
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
                log.info("move: the catalog did not answer (%s); trying again", exc)
                await asyncio.sleep(RETRY_SEC)

    async def _phase_under_way(self) -> str | None:
        """The phase of the move under way (None: none), read from the catalog."""
        rows = await self._fetch("SELECT phase FROM shard_moves WHERE phase IN ('copying', 'fenced', 'cut_over')")
        return str(rows[0]["phase"]) if rows else None

    async def _last_outcome(self) -> tuple[int, str] | None:
        rows = await self._fetch("SELECT move_id, phase FROM shard_moves ORDER BY move_id DESC LIMIT 1")
        return (rows[0]["move_id"], rows[0]["phase"]) if rows else None

    async def _read_outcomes(self) -> None:
        """Each window's final phase and cut-over time, from the catalog's record of its move."""
        rows = {r["move_id"]: r for r in await self._fetch("SELECT move_id, phase, cut_over_at FROM shard_moves")}
        for window in self.windows:
            row = rows.get(window.move_id) if window.move_id is not None else None
            if row is not None:
                window.outcome = row["phase"]
                window.cut_over_at = row["cut_over_at"].timestamp() if row["cut_over_at"] is not None else None

    def figures(self) -> dict[str, int]:
        return {
            "moves": len(self.windows),
            "moves_done": sum(1 for w in self.windows if w.outcome == "done"),
            "moves_cancelled": sum(1 for w in self.windows if w.outcome == "cancelled"),
            "moves_not_begun": sum(1 for w in self.windows if not w.outcome),  # killed before it was recorded
            "movers_killed": sum(w.kills for w in self.windows),
            "moves_resumed": sum(w.resumes for w in self.windows),
            "moves_cancelled_after_kill": sum(1 for w in self.windows if w.cancels and w.outcome == "cancelled"),
            "move_commands_failed": sum(w.failed_commands for w in self.windows),
            "move_commands": self.commands,
        }
