"""How quiet the machine was (bench/quiet.py) and the spread of figures over --repeat (bench/report.py)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from bench import quiet
from bench.quiet import (
    CpuTicks,
    Quietness,
    parse_cpu_line,
    probe_spread,
    read_cpu_ticks,
    settle,
    speed_probe_ms,
    spread,
    steal_percent,
    verdict,
    watch,
)
from bench.report import Result, spread_table


def test_the_aggregate_cpu_line_is_read_without_counting_guest_time_twice() -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    ticks = parse_cpu_line("cpu  100 5 50 800 10 0 5 30 70 0")
    assert ticks == CpuTicks(total=1000, steal=30)


@pytest.mark.parametrize("line", ["", "cpu0 1 2 3 4 5 6 7 8", "cpu 1 2 3", "intr 1 2 3 4 5 6 7 8 9"])
def test_a_line_that_is_not_the_aggregate_cpu_line_is_refused(line: str) -> None:
    with pytest.raises(ValueError, match="not the aggregate cpu line"):
        parse_cpu_line(line)


@pytest.mark.parametrize(("before", "after", "percent"), [
    (CpuTicks(1000, 10), CpuTicks(2000, 60), 5.0),
    (CpuTicks(1000, 10), CpuTicks(1400, 10), 0.0),
    (CpuTicks(1000, 10), CpuTicks(1000, 10), None),  # no time passed: nothing to say
])
def test_steal_is_the_share_of_the_cpu_time_between_two_readings(before: CpuTicks, after: CpuTicks,
                                                                 percent: float | None) -> None:
    assert steal_percent(before, after) == percent


def test_a_missing_proc_stat_reports_no_steal_rather_than_failing(tmp_path: Path) -> None:
    assert read_cpu_ticks(tmp_path / "absent") is None
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 0 1 10 0 0 0 2 0 0\ncpu0 1 0 1 10 0 0 0 2 0 0\n")
    assert read_cpu_ticks(stat) == CpuTicks(total=14, steal=2)


@pytest.mark.parametrize(("load", "steal_before", "steal_during", "reasons"), [
    (0.4, 0.0, 0.5, []),
    (1.0, 2.0, 2.0, []),  # the limits themselves are still quiet
    (1.01, 0.0, 0.0, ["load average 1.01 before the round on 2 cores (more than 0.5 per core)"]),
    (0.2, None, 7.5, ["CPU steal 7.5% during the round (more than 2%)"]),
    (3.0, 2.5, None, ["load average 3.00 before the round on 2 cores (more than 0.5 per core)",
                      "CPU steal 2.5% before the round (more than 2%)"]),
])
def test_a_round_is_busy_when_load_before_it_or_steal_passes_the_limits(
        load: float, steal_before: float | None, steal_during: float | None, reasons: list[str]) -> None:
    record = Quietness(cores=2, load_before=[load, 0.0, 0.0], steal_before_percent=steal_before,
                       load_during_max=9.0, steal_during_percent=steal_during)  # load during is the benchmark's own
    assert verdict(record) == reasons


async def test_watch_fills_in_the_record_when_the_block_ends() -> None:
    async with watch(sample_sec=0.05) as record:
        assert record.load_during_max is None and record.cores == (os.cpu_count() or 1)
        await asyncio.sleep(0.05)
    assert record.load_during_max is not None and record.load_during_max >= 0
    assert record.seconds >= 0.05 and len(record.load_before) == 3
    assert record.busy == verdict(record)
    assert ("BUSY" in record.describe()) == bool(record.busy)
    assert record.probe_ms is not None and record.probe_ms > 0
    assert f"speed probe {record.probe_ms:.1f} ms" in record.describe()


def test_the_speed_probe_is_the_best_of_its_repeats(monkeypatch: pytest.MonkeyPatch) -> None:
    # the clock's readings around each repeat: 30 ms, 2 ms, 30 ms (one quick repeat among slow ones)
    readings = iter([0.0, 0.030, 1.0, 1.002, 2.0, 2.030])
    monkeypatch.setattr(quiet, "_probe_work", lambda: 0)
    assert 2.0 <= speed_probe_ms(repeat=3, clock=lambda: next(readings)) < 30.0


def _probed(*probes: float | None) -> list[Quietness]:
    return [Quietness(cores=2, load_before=[0.1, 0.1, 0.1], steal_before_percent=0.0, probe_ms=p) for p in probes]


def test_rounds_whose_speed_probes_differ_by_more_than_a_tenth_get_a_note() -> None:
    assert probe_spread(_probed(10.0, 10.9, 11.0)) is None  # 10% slower at most: the limit itself is close
    assert probe_spread(_probed(10.0)) is None and probe_spread(_probed(None, 12.0)) is None
    assert probe_spread(_probed(10.0, 11.5, 16.0)) == (
        "NOTE: the machine's speed changed between rounds: speed probe 10.0 to 16.0 ms (60% slower at most): "
        "compare rounds with close probes")


def test_spread_is_min_median_max_of_two_or_more_values() -> None:
    assert spread([3.0, 1.0, 2.0]) == (1.0, 2.0, 3.0)
    assert spread([4.0, 1.0]) == (1.0, 2.5, 4.0)
    assert spread([1.0]) is None and spread([]) is None


def _result(system: str, drain: float, cpu: float) -> Result:
    return Result(system, "burst", 1000, 1000, drain, start_lag={"p50": 1.0, "p95": 2.0, "p99": drain, "max": drain},
                  cpu_sec={"worker": cpu})


def test_the_spread_table_groups_the_rounds_of_each_system() -> None:
    results = [_result("chimes", 2.0, 0.5), _result("PgQueuer", 3.0, 0.4), _result("chimes", 4.0, 0.7),
               _result("PgQueuer", 5.0, 0.6), _result("chimes", 1.0, 0.6)]
    lines = spread_table(results).splitlines()
    assert lines[0] == ("  chimes, 3 rounds, min / median / max: drain s 1.00 / 2.00 / 4.00; runs/s 250 / 500 / "
                        "1,000; start lag p99 s 1.00 / 2.00 / 4.00; CPU s/1000 0.50 / 0.60 / 0.70")
    assert lines[1].startswith("  PgQueuer, 2 rounds, min / median / max: drain s 3.00 / 4.00 / 5.00;")
    # top-of-hour names its rounds; they are one system
    named = [_result("chimes scheduler, round 1", 2.0, 0.5), _result("chimes scheduler, round 2", 3.0, 0.5)]
    assert spread_table(named).startswith("  chimes scheduler, 2 rounds")
    assert spread_table([_result("chimes", 2.0, 0.5)]) == ""  # one round: nothing to spread


async def test_settle_waits_until_the_load_average_falls_to_the_quiet_limit() -> None:
    loads = iter([1.6, 1.3, 1.1, 0.9, 0.7])
    waited = await settle(60, load=lambda: next(loads), cores=2, sample_sec=0.001)
    assert waited == pytest.approx(0.003)  # 1.6, 1.3 and 1.1 are above 0.5 a core on two cores; 0.9 is not


async def test_settle_gives_up_after_its_limit_on_a_machine_that_stays_busy() -> None:
    samples = []

    def load() -> float:
        samples.append(1)
        return 3.0

    waited = await settle(0.005, load=load, cores=2, sample_sec=0.001)
    assert waited == pytest.approx(0.005)
    assert len(samples) == 6  # read before each wait, and once more at the limit
