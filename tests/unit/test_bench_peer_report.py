"""The figures of `python -m bench peers` (bench/peer_report.py) and the shapes it gives each system
(bench/peers.py, bench/peer_run.py): decided without running anything."""

from __future__ import annotations

import itertools
from pathlib import Path

import orjson
import pytest

from bench.peer_report import (
    Measurement,
    Pair,
    combined,
    flag,
    headline,
    measurements_of,
    paired_ratios,
    round_order,
    summarise,
)
from bench.peer_run import pgqueuer_layout
from bench.peers import Layout, argument_problem, chimes_concurrency, next_poll
from bench.report import Result

SYSTEMS = ["chimes", "pgqueuer", "procrastinate", "celery"]


def m(system: str, drain: float | None, *, sitting: str = "a", number: int = 1, variant: str = "noop",
      most: int | None = None, stated: int = 200, completed: int = 1000, busy: bool = False) -> Measurement:
    return Measurement(sitting, number, variant, system, system.title(), 1000, completed, drain, stated, most, busy)


def test_the_order_alternates_every_round() -> None:
    orders = [round_order(SYSTEMS, i) for i in range(4)]
    assert orders[0] == SYSTEMS and orders[2] == SYSTEMS
    assert orders[1] == orders[3] == list(reversed(SYSTEMS))
    for before, after in itertools.pairwise(orders):
        assert before[0] != after[0]  # nobody runs first twice in a row
        # every pair of systems swaps its order from one round to the next
        for x in SYSTEMS:
            for y in SYSTEMS:
                if x != y:
                    assert (before.index(x) < before.index(y)) != (after.index(x) < after.index(y))


def test_a_ratio_pairs_a_peer_with_chimes_in_the_same_round_of_the_same_variant() -> None:
    found = paired_ratios([
        m("chimes", 1.0), m("pgqueuer", 2.5), m("procrastinate", 4.0),
        m("chimes", 2.0, number=2), m("pgqueuer", 3.0, number=2),
        m("chimes", 1.0, variant="http"), m("pgqueuer", 1.5, variant="http"),
        m("pgqueuer", 9.0, number=3),  # no Chimes in round 3: nothing to pair with
        m("chimes", 4.0, sitting="b"), m("pgqueuer", 2.0, sitting="b"),
    ])
    assert found[("noop", "pgqueuer")] == [Pair("a", 1, 2.5), Pair("a", 2, 1.5), Pair("b", 1, 0.5)]
    assert found[("noop", "procrastinate")] == [Pair("a", 1, 4.0)]
    assert found[("http", "pgqueuer")] == [Pair("a", 1, 1.5)]
    assert set(found) == {("noop", "pgqueuer"), ("noop", "procrastinate"), ("http", "pgqueuer")}


def test_a_system_over_its_runs_in_flight_is_flagged_and_left_out_of_the_ratios() -> None:
    over = m("pgqueuer", 1.0, variant="http", most=201)
    within = m("procrastinate", 5.0, variant="http", most=200)
    assert over.over_concurrency and not over.measured
    assert flag(over) == ("NOT MEASURED LIKE THE OTHERS: 201 calls at once at the target, over its 200 in flight")
    assert not within.over_concurrency and flag(within) == ""
    assert not m("pgqueuer", 1.0, most=None).over_concurrency  # the no-op makes no call: nothing counted
    # Chimes over its own: no round of that variant is paired, whoever the peer
    chimes_over = m("chimes", 1.0, variant="http", most=250, number=2)
    found = paired_ratios([m("chimes", 1.0, variant="http"), over, within, chimes_over,
                           m("pgqueuer", 2.0, variant="http", number=2)])
    assert found == {("http", "procrastinate"): [Pair("a", 1, 5.0)]}
    text = "\n".join(headline([m("chimes", 1.0, variant="http"), over, within]))
    assert "left out: Pgqueuer, http, sitting a round 1: NOT MEASURED LIKE THE OTHERS" in text


def test_an_incomplete_drain_is_left_out() -> None:
    short = m("pgqueuer", 3.0, completed=999)
    assert not short.measured and flag(short) == "INCOMPLETE: 999 of 1,000 runs done"
    assert paired_ratios([m("chimes", 1.0), short, m("celery", None)]) == {}


def test_the_summary_is_the_median_of_the_paired_ratios_with_their_range() -> None:
    pairs = [Pair("a", 1, 2.0), Pair("a", 2, 1.5), Pair("b", 1, 3.0), Pair("c", 1, 1.8)]
    summary = summarise(pairs)
    assert (summary.median, summary.low, summary.high, summary.rounds, summary.sittings) == (1.9, 1.5, 3.0, 4, 3)
    assert summarise([Pair("a", 1, 2.0), Pair("a", 2, 1.0), Pair("a", 3, 4.0)]).median == 2.0
    with pytest.raises(ValueError):
        summarise([])


def test_a_headline_from_fewer_than_three_sittings_says_it_is_not_to_be_published() -> None:
    two = [m("chimes", 1.0, sitting=s) for s in "ab"] + [m("pgqueuer", 2.0, sitting=s) for s in "ab"]
    (line,) = headline(two)
    assert line == ("  noop: Pgqueuer's drain over Chimes': 2.00x (range 2.00-2.00x, 2 paired rounds, 2 sittings); "
                    "fewer than 3 sittings: not a figure to publish")
    three = [*two, m("chimes", 1.0, sitting="c"), m("pgqueuer", 3.0, sitting="c", busy=True)]
    lines = headline(three)
    assert lines[0] == "  noop: Pgqueuer's drain over Chimes': 2.00x (range 2.00-3.00x, 3 paired rounds, 3 sittings)"
    assert lines[1].startswith("  WARNING: 1 of 6 measurements began on a busy machine")


def _result(system: str, drain: float, variant: str, number: int, most: int | None, busy: list[str]) -> Result:
    result = Result(system.title(), "peers", 1000, 1000, drain)
    result.extra = {"system_key": system, "variant": variant, "round": number,
                    "in_flight": {"stated": 200, "most_at_target": most},
                    "machine": {"load_before": [0.3, 0.2, 0.1], "busy": busy}}
    return result


def test_the_measurements_are_read_back_from_a_sitting_s_json(tmp_path: Path) -> None:
    results = [_result("chimes", 1.0, "http", 1, 180, []), _result("pgqueuer", 2.0, "http", 1, 200, ["load"])]
    found = measurements_of([r.to_json() for r in results], "s1")
    assert found == [Measurement("s1", 1, "http", "chimes", "Chimes", 1000, 1000, 1.0, 200, 180, False),
                     Measurement("s1", 1, "http", "pgqueuer", "Pgqueuer", 1000, 1000, 2.0, 200, 200, True)]
    assert measurements_of([Result("x", "burst", 1, 1, 1.0).to_json()], "s1") == []  # another scenario's


def test_several_sittings_combine_into_one_headline_with_each_command_and_its_load(tmp_path: Path) -> None:
    paths = []
    for n, (chimes, peer) in enumerate([(1.0, 2.0), (1.0, 2.4), (2.0, 3.0)]):
        path = tmp_path / f"sitting{n}.json"
        results = [_result("chimes", chimes, "noop", 1, None, []), _result("pgqueuer", peer, "noop", 1, None, [])]
        path.write_bytes(orjson.dumps({"scenario": "peers", "command": f"python -m bench peers --json {path.name}",
                                       "machine": {"cores": 2, "cpu": "test"},
                                       "results": [r.to_json() for r in results]}))
        paths.append(path)
    text = combined(paths)
    assert f"{paths[0]}: python -m bench peers --json sitting0.json; 2 cores (test)" in text
    assert "load average before each measurement 0.30-0.30" in text
    assert "noop: Pgqueuer's drain over Chimes': 2.00x (range 1.50-2.40x, 3 paired rounds, 3 sittings)" in text
    with pytest.raises(ValueError, match="given twice"):
        combined([paths[0], paths[0]])
    other = tmp_path / "burst.json"
    other.write_bytes(orjson.dumps({"scenario": "burst", "machine": {}, "results": []}))
    with pytest.raises(ValueError, match="not the JSON of `python -m bench peers`"):
        combined([other])


@pytest.mark.parametrize("per_process", [1, 2, 3, 7, 20, 40, 100, 133, 200, 1000])
@pytest.mark.parametrize("share", [0.8, 0.5, 0.75, 1.0, 0.33])
def test_chimes_worker_concurrency_gives_one_owner_exactly_its_share_of_the_runs_in_flight(
        per_process: int, share: float) -> None:
    concurrency = chimes_concurrency(per_process, share)
    assert int(concurrency * share) == per_process  # the owner cap (chimes.worker.tiers)
    assert int((concurrency - 1) * share) < per_process  # and the least concurrency that gives it


def test_chimes_at_its_default_share_gets_250_slots_for_200_in_flight() -> None:
    assert chimes_concurrency(200, 0.8) == 250 and chimes_concurrency(100, 0.8) == 125


def test_the_runs_in_flight_are_shared_evenly_by_the_worker_processes() -> None:
    assert Layout(2, 200).per_process == 100 and Layout(2, 200).problem() is None
    assert Layout(3, 200).problem() == "--in-flight (200) must be shared evenly by --workers (3)"
    assert Layout(1, 1).problem() is not None


def test_the_command_s_systems_variants_and_layout_are_checked_before_anything_starts() -> None:
    assert argument_problem(SYSTEMS, ["noop", "http"], Layout()) is None
    assert argument_problem(["chimes", "apscheduler"], ["noop"], Layout()) == (
        "unknown system or variant 'apscheduler'; systems: chimes, pgqueuer, procrastinate, celery; "
        "variants: noop, http")
    assert argument_problem(["chimes"], ["sleep"], Layout()).startswith("unknown system or variant 'sleep'")
    assert argument_problem(["chimes"], ["http"], Layout(hold_ms=-1)) == "--hold-ms must be 0 to 60000, not -1"
    assert argument_problem(["chimes"], ["http"], Layout(2, 201)) is not None


def test_the_finish_line_observer_reads_on_a_grid_from_the_due_instant() -> None:
    assert next_poll(100.0, 100.01, 0.05) == pytest.approx(100.05)
    # a read that overran skips the instants it missed instead of drifting from the grid
    assert next_poll(100.0, 100.17, 0.05) == pytest.approx(100.2)
    assert next_poll(100.0, 99.9, 0.05) == pytest.approx(100.05)  # always forward


@pytest.mark.parametrize("in_flight", [2, 3, 10, 20, 39, 40, 100, 200])
def test_pgqueuer_s_queue_managers_share_the_runs_in_flight_as_it_requires(in_flight: int) -> None:
    layout = pgqueuer_layout(in_flight)
    assert sum(layout.per_manager) == in_flight
    assert all(most >= 2 * layout.batch_size for most in layout.per_manager)  # PgQueuer refuses less
    assert 1 <= len(layout.per_manager) <= 5 and 1 <= layout.batch_size <= 10


def test_pgqueuer_at_200_in_flight_runs_as_its_own_benchmark_does() -> None:
    assert pgqueuer_layout(200).to_json() == {"queue_managers": 5, "batch_size": 10,
                                              "max_concurrent_tasks": [40, 40, 40, 40, 40]}
    with pytest.raises(ValueError):
        pgqueuer_layout(1)
