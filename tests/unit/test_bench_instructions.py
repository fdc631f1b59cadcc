"""`python -m bench worker-instructions`: reading cachegrind's counts, the cost of one more run, and the
arguments it refuses before anything starts."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from bench.__main__ import main
from bench.instructions import per_run_costs, read_counts

# Cachegrind's output format (valgrind's docs, "Cachegrind: output file format"): a function's lines
# follow its fl= and fn=; fi=/fe= switch the source file of inlined lines, within the same function.
CACHEGRIND_OUT = """\
desc: I1 cache:         32768 B, 64 B, 8-way associative
cmd: python -m chimes worker
events: Ir
fl=/src/Python/ceval.c
fn=_PyEval_EvalFrameDefault
10 400
11 100
fi=/src/Include/object.h
12 50
fe=/src/Python/ceval.c
13 25
fn=initialize_locals
20 30
fl=???
fn=curlx_str_until
0 70
summary: 675
"""


def test_read_counts_adds_up_each_functions_lines_inlined_ones_included(tmp_path: Path) -> None:
    out = tmp_path / "cachegrind.out"
    out.write_text(CACHEGRIND_OUT)
    total, by_function = read_counts(out)
    assert total == 675
    assert by_function == {"ceval.c:_PyEval_EvalFrameDefault": 575, "ceval.c:initialize_locals": 30,
                           "???:curlx_str_until": 70}


def test_one_more_run_costs_the_difference_over_the_runs_between() -> None:
    smaller = (1_000_000, Counter({"a": 600_000, "b": 400_000}))
    larger = (4_000_000, Counter({"a": 2_400_000, "b": 1_300_000, "c": 300_000}))
    per_run, functions = per_run_costs(smaller, larger, 1_000)
    assert per_run == 3_000
    assert functions == [("a", 1_800), ("b", 900), ("c", 300)]


def test_without_valgrind_nothing_starts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH with no valgrind on it
    with pytest.raises(SystemExit):
        main(["worker-instructions", "--runs", "8000"])
    assert "worker-instructions needs valgrind on the PATH (apt-get install valgrind)" in capsys.readouterr().err


def test_too_few_runs_are_refused_before_anything_starts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    valgrind = tmp_path / "valgrind"  # found on the PATH; never run, as the arguments are refused first
    valgrind.write_text("#!/bin/sh\nexit 1\n")
    valgrind.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit):
        main(["worker-instructions", "--runs", "100"])
    assert "worker-instructions needs --runs 400 or more, not 100" in capsys.readouterr().err
