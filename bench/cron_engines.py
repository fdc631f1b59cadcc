"""Cron engines side by side: python -m bench.cron_engines (about a minute, one core).

Times one uncached next fire (what the bulk import and the scheduler pay per distinct expression
and second) for typical expressions in UTC and America/New_York, with three wall-time evaluators
under the same DST mapping (chimes.cron's): Chimes' own matcher, croniter (the engine before it)
and cronsim in naive wall time. Best of five rounds; the load average is printed, since the
figures are only comparable within one run.
"""

from __future__ import annotations

import os
import timeit
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta

from croniter import croniter
from cronsim import CronSim

from chimes import cron

EXPRESSIONS = ("*/5 * * * *", "0 * * * *", "0 2 * * *", "30 9 * * 1-5", "0 0 1 * *", "*/15 9-17 * * MON-FRI",
               "0 6 1,15 * *")
ZONES = ("UTC", "America/New_York")
AFTER = datetime(2026, 6, 15, 10, 7, 13)  # naive UTC, as chimes.cron works internally
CALLS = 2_000


Walls = Callable[[str, datetime], Iterator[datetime]]


def _mapped(schedule: cron.CronSchedule, after: datetime, walls: Walls) -> datetime:
    """chimes.cron._search with another wall-time iterator."""
    parsed = cron._parse(schedule.expression)
    zone = cron.parse_timezone(schedule.timezone)
    fields = " ".join(schedule.expression.split())
    if zone.key in cron._UTC_KEYS:
        return next(walls(fields, after))
    gap, fold = cron._policies(schedule, parsed)
    first = last = None
    for wall in walls(fields, cron._start_wall(after, zone)):
        images = cron._images(wall, zone, gap, fold)
        if images and first is None and images[0] > after:
            first = images[0]
        if images and last is None and images[-1] > after:
            last = images[-1]
        if first is not None and last is not None:
            return min(first, last)
    raise AssertionError("no fire")


def _croniter_walls(fields: str, start: datetime) -> Iterator[datetime]:
    walls = croniter(fields, start, ret_type=datetime, second_at_beginning=len(fields.split()) == 6)
    while True:
        yield walls.get_next(datetime)


def _cronsim_walls(fields: str, start: datetime) -> Iterator[datetime]:
    return iter(CronSim(fields, start))


ENGINES: dict[str, Callable[[cron.CronSchedule, datetime], datetime | None]] = {
    "chimes": cron._search,
    "croniter": lambda schedule, after: _mapped(schedule, after, _croniter_walls),
    "cronsim": lambda schedule, after: _mapped(schedule, after, _cronsim_walls),
}


def main() -> None:
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    schedules = [cron.validate_cron(e, z) for z in ZONES for e in EXPRESSIONS]
    afters = [AFTER + timedelta(seconds=97 * i) for i in range(CALLS // len(schedules) + 1)]
    for schedule in schedules:  # the engines agree on these (the differential test covers the rest)
        answers = {name: engine(schedule, AFTER) for name, engine in ENGINES.items()}
        assert len(set(answers.values())) == 1, (schedule, answers)
    print(f"{'engine':10} {'UTC µs/call':>12} {'New York µs/call':>17}")
    for name, engine in ENGINES.items():
        per_zone = []
        for zone in ZONES:
            batch = [s for s in schedules if s.timezone == zone]

            def calls(batch: list[cron.CronSchedule] = batch, engine: Callable[..., object] = engine) -> None:
                for after in afters:
                    for schedule in batch:
                        engine(schedule, after)

            best = min(timeit.repeat(calls, number=1, repeat=5))
            per_zone.append(best / (len(afters) * len(batch)) * 1e6)
        print(f"{name:10} {per_zone[0]:12.1f} {per_zone[1]:17.1f}")
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
