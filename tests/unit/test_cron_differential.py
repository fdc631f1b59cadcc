"""chimes.cron against an independent Debian cron reference, on random expressions in zones with
odd DST rules (30-minute shifts, transitions at 02:45 and at midnight), starting just before their
transitions.

The reference: cronsim (the evaluator Healthchecks.io runs, written to mimic Debian cron) matches
the fields against naive wall times, and debian_images below maps each wall time to instants the
way Debian's cron daemon does. cronsim's own zone handling is not used: it steps hour by hour in
aware time and so skips 04:00 after Lord Howe's 30-minute fall-back, or runs Santiago's missing
midnight.

Each run draws its own seed and prints it; CHIMES_CRON_SEED=N replays a run. The generator only
writes syntax both evaluators accept (Chimes' extensions that cronsim lacks, wrap-around ranges,
nW, ?, Ld, are covered in test_cron.py). Chimes' DST defaults differ from Debian's on purpose for some
expressions (docs/semantics.md, "Cron expressions"); there the policy Debian would use is passed
explicitly, so the evaluation itself is still compared.
"""

from __future__ import annotations

import os
import random
import time
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from cronsim import CronSim, CronSimError

from chimes.cron import CronError, CronSchedule, fire_times, validate_cron

ZONES = ("Australia/Lord_Howe", "Pacific/Chatham", "America/Santiago", "Asia/Tehran", "America/New_York",
         "Europe/London", "Europe/Berlin", "Australia/Adelaide", "America/St_Johns", "UTC")
EXPRESSIONS = 1200
FIRES = 4
# cronsim gives up 50 years after its start; compare within a window it always searches.
WINDOW = timedelta(days=365 * 45)
MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")


def transitions(zone: ZoneInfo, years: range) -> list[datetime]:
    """UTC instants (to the minute) where the zone's offset changes."""
    found: list[datetime] = []
    moment = datetime(years.start, 1, 1, tzinfo=UTC)
    end = datetime(years.stop, 1, 1, tzinfo=UTC)
    step = timedelta(hours=1)
    while moment < end:
        later = moment + step
        if moment.astimezone(zone).utcoffset() != later.astimezone(zone).utcoffset():
            low = moment
            while later - low > timedelta(minutes=1):
                middle = low + (later - low) / 2
                if middle.astimezone(zone).utcoffset() == low.astimezone(zone).utcoffset():
                    low = middle
                else:
                    later = middle
            found.append(later)
        moment += step
    return found


class Generator:
    """Random fields in the grammar both evaluators read: numbers, names, a-b, a-a, */n, a/n,
    a-b/n, lists; L, LW in day-of-month; d#n, dL in day-of-week."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def value(self, low: int, high: int, names: tuple[str, ...] = (), offset: int = 0) -> str:
        number = self.rng.randint(low, high)
        if names and number - offset < len(names) and self.rng.random() < 0.3:
            name = names[number - offset]
            return name.upper() if self.rng.random() < 0.5 else name
        return str(number)

    def term(self, low: int, high: int, names: tuple[str, ...] = (), offset: int = 0,
             hot: tuple[int, ...] = ()) -> str:
        rng = self.rng
        kind = rng.choice(("value", "value", "range", "same", "step_all", "step_from", "step_range"))
        if hot and rng.random() < 0.5:  # values near DST transitions
            low, high = min(hot), max(hot)
        if kind == "value":
            return self.value(low, high, names, offset)
        if kind == "same":
            single = self.value(low, high, names, offset)
            return f"{single}-{single}"
        if kind == "step_all":
            return f"*/{rng.randint(1, high - low + 2)}"
        a, b = sorted((rng.randint(low, high), rng.randint(low, high)))
        if kind == "range":
            return f"{a}-{b}"
        if kind == "step_from":
            return f"{self.value(a, a, names, offset)}/{rng.randint(1, max(1, high - a + 1))}"
        return f"{a}-{b}/{rng.randint(1, max(1, b - a + 1))}"

    def field(self, low: int, high: int, names: tuple[str, ...] = (), offset: int = 0,
              hot: tuple[int, ...] = (), star: float = 0.3) -> str:
        rng = self.rng
        if rng.random() < star:
            return "*"
        count = rng.choice((1, 1, 1, 2, 3))
        return ",".join(self.term(low, high, names, offset, hot) for _ in range(count))

    def dom(self) -> str:
        rng = self.rng
        special = rng.random()
        if special < 0.05:
            return "L"
        if special < 0.08:
            return "LW"
        if special < 0.11:
            return f"{rng.randint(1, 28)},L"
        return self.field(1, 31, star=0.45)

    def dow(self) -> str:
        rng = self.rng
        special = rng.random()
        if special < 0.06:
            return f"{self.value(0, 7, DAYS)}#{rng.randint(1, 5)}"
        if special < 0.10:
            return f"{rng.randint(0, 7)}L"
        if special < 0.12:
            return f"{rng.randint(1, 5)},{rng.randint(0, 6)}#{rng.randint(1, 4)}"
        return self.field(0, 7, DAYS, star=0.45)

    def expression(self) -> str:
        rng = self.rng
        fields = [
            self.field(0, 59, hot=(0, 15, 30, 45), star=0.2),
            self.field(0, 23, hot=(0, 1, 2, 3, 23), star=0.25),
            self.dom(),
            self.field(1, 12, MONTHS, offset=1, star=0.6),
            self.dow(),
        ]
        if rng.random() < 0.1:
            fields.insert(0, rng.choice(("0", "30", "*/20", "15-15", "10,50")))
        return " ".join(fields)


def debian_policy(expression: str, zone: str) -> tuple[str, str]:
    """The DST treatment cronsim (like Debian) gives: a 5-field expression whose minute and hour
    fields do not begin with '*' runs at wall-clock times (gap: shifted, fold: first pass); others
    follow elapsed time (gap: skipped, fold: both passes)."""
    fields = expression.split()
    fixed = len(fields) == 5 and not fields[0].startswith("*") and not fields[1].startswith("*") and zone != "UTC"
    return ("shift", "first") if fixed else ("skip", "both")


def chimes_schedule(expression: str, zone: str) -> CronSchedule:
    """Chimes' defaults where they agree with Debian's, explicit policies where they do not."""
    gap, fold = debian_policy(expression, zone)
    defaults = validate_cron(expression, zone)
    automatic = ("skip", "both") if len(set(fire_hours(expression))) == 24 else ("shift", "first")
    if automatic == (gap, fold):
        return defaults
    return validate_cron(expression, zone, dst_gap=gap, dst_fold=fold)


def fire_hours(expression: str) -> list[int]:
    """The hours the hour field names, read by cronsim's own parser."""
    fields = expression.split()
    if len(fields) == 5:
        fields.insert(0, "0")
    return sorted(h for h in CronSim(" ".join(fields), datetime(2000, 1, 1)).hours)


def _offset(moment: datetime, zone: ZoneInfo) -> timedelta:
    offset = moment.astimezone(zone).utcoffset()
    assert offset is not None
    return offset


def dst_delta(zone: ZoneInfo, near: list[datetime]) -> timedelta:
    """The largest offset change at the zone's transitions (30 minutes on Lord Howe)."""
    day = timedelta(hours=12)
    changes = [abs(_offset(t + day, zone) - _offset(t - day, zone)) for t in near]
    return max(changes, default=timedelta(0))


def debian_images(wall: datetime, zone: ZoneInfo, fixed: bool) -> list[datetime]:
    """Debian cron's instants for one wall time: a job at a fixed time runs a wall time that the
    clock skips at the first minute after the gap and a repeated one on its first pass; a wildcard
    job follows the clock, so it misses skipped times and runs repeated ones twice."""
    early = wall.replace(tzinfo=zone, fold=0)
    late = wall.replace(tzinfo=zone, fold=1)
    assert early.utcoffset() is not None and late.utcoffset() is not None
    if early.utcoffset() == late.utcoffset():
        return [early.astimezone(UTC)]
    if early.utcoffset() > late.utcoffset():  # type: ignore[operator]
        return [early.astimezone(UTC)] if fixed else [early.astimezone(UTC), late.astimezone(UTC)]
    if not fixed:
        return []
    moved = wall
    while moved.replace(tzinfo=zone).astimezone(UTC).astimezone(zone).replace(tzinfo=None) != moved:
        moved += timedelta(minutes=1)
    return [moved.replace(tzinfo=zone).astimezone(UTC)]


def reference_fires(expression: str, zone: ZoneInfo, delta: timedelta, start: datetime,
                    end: datetime) -> list[datetime] | None:
    """The first FIRES instants in (start, end] as Debian cron runs them; None if cronsim refuses
    the expression. cronsim matches the fields against naive wall times (where it has no DST
    handling to differ on); debian_images maps them to instants."""
    fixed = debian_policy(expression, zone.key) == ("shift", "first")
    begin = start.astimezone(zone).replace(tzinfo=None) - delta
    try:
        walls = CronSim(expression, begin)
    except CronSimError:
        return None
    found: set[datetime] = set()
    for wall in walls:
        if wall - timedelta(hours=15) > end.replace(tzinfo=None):
            break
        # No later wall time can map before this, whatever DST change comes after it.
        earliest = wall.replace(tzinfo=zone, fold=1).astimezone(UTC) - 2 * delta
        if len(found) >= FIRES and earliest > sorted(found)[FIRES - 1]:
            break
        found.update(t for t in debian_images(wall, zone, fixed) if start < t <= end)
    return sorted(found)[:FIRES]


def test_chimes_agrees_with_debian_cron_around_dst_transitions() -> None:
    seed = int(os.environ.get("CHIMES_CRON_SEED") or time.time_ns() % 2**32)
    print(f"CHIMES_CRON_SEED={seed}")
    rng = random.Random(seed)
    generate = Generator(rng)
    starts = {name: transitions(ZoneInfo(name), range(2026, 2029)) for name in ZONES}
    deltas = {name: dst_delta(ZoneInfo(name), starts[name]) for name in ZONES}
    disagreements: list[str] = []
    compared = 0
    for _ in range(EXPRESSIONS):
        expression = generate.expression()
        for name in ZONES:
            zone = ZoneInfo(name)
            near = starts[name]
            if near:
                start = rng.choice(near) - timedelta(seconds=rng.randint(1, 30 * 3600))
            else:  # no DST: any instant
                start = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=rng.randint(0, 3 * 365 * 86400))
            start = start.astimezone(zone)
            expected = reference_fires(expression, zone, deltas[name], start, start + WINDOW)
            try:
                schedule = chimes_schedule(expression, name)
            except CronError as error:
                if expected:
                    disagreements.append(f"{expression!r} {name}: Chimes refuses ({error}), Debian fires {expected}")
                continue
            if expected is None:
                disagreements.append(f"{expression!r} {name}: cronsim refuses it, Chimes accepts it")
                continue
            actual = fire_times(schedule, start, start + WINDOW, FIRES)
            compared += 1
            if actual != expected:
                disagreements.append(
                    f"{expression!r} {name} after {start.isoformat()}: Chimes {actual}, Debian {expected}")
    assert compared > EXPRESSIONS * len(ZONES) // 2
    assert not disagreements, f"CHIMES_CRON_SEED={seed}: {len(disagreements)} disagreements:\n" + "\n".join(
        disagreements[:20])
