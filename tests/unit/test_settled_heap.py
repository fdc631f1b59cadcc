"""A process that fires or runs runs settles its heap once it is set up (chimes.cli.roles): what it made
to start is frozen out of the garbage collector's sight, and the youngest generation is collected
after GC_YOUNG_THRESHOLD allocations instead of Python's 700, so that the runs in flight are not
carried through every generation. Checked in a fresh interpreter, whose collector this test may change."""

from __future__ import annotations

import json
import subprocess
import sys

from chimes.cli.roles import GC_YOUNG_THRESHOLD

_PROBE = """
import gc, json
from chimes.cli.roles import _settle_the_heap

before = gc.get_threshold()
_settle_the_heap()
collections = []
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
# A burst's worth of runs in flight: objects that stay alive a while and make no cycles.
in_flight = [{"run": n, "headers": {"a": str(n)}, "tail": [n]} for n in range(2_000)]
print(json.dumps({"before": before, "after": gc.get_threshold(), "frozen": gc.get_freeze_count(),
                  "collections": collections}))
"""


def _settled(*, young: int | None = None) -> dict[str, object]:
    probe = _PROBE if young is None else _PROBE.replace("_settle_the_heap()\n", f"gc.set_threshold({young})\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_the_settled_heap_is_frozen_and_its_young_generation_collected_less_often() -> None:
    settled = _settled()
    before, after = settled["before"], settled["after"]
    assert isinstance(before, list) and isinstance(after, list)
    assert after == [GC_YOUNG_THRESHOLD, before[1], before[2]]  # the older generations keep their ratios
    assert isinstance(settled["frozen"], int) and settled["frozen"] > 10_000  # the modules, schemas, tables
    # 2,000 runs' objects (6,000 containers) alive at once: no collection with the settled heap, where
    # Python's default threshold collects every 700 of them, carrying the runs into older generations.
    assert settled["collections"] == []
    by_default = _settled(young=700)["collections"]
    assert isinstance(by_default, list) and len(by_default) >= 6000 // 700
