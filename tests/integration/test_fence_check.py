"""Removing any one fence from the SQL makes at least one deterministic test fail.

Runs ``python -m tests.fence_check`` (every fence neutralised in turn in a copy of the package, its
tests run against the copy, two mutants at a time) on the suite's PostgreSQL (docs/reliability.md).
"""

from __future__ import annotations

import io

import pytest

from tests import fence_check

pytestmark = pytest.mark.long  # the suite run again once per fence removed


def test_every_listed_clause_is_in_the_sql() -> None:
    assert fence_check.stale_entries() == []


@pytest.mark.timeout(900)
def test_removing_any_fence_fails_a_test(server_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHIMES_DATABASE_URL", server_dsn)
    report = io.StringIO()
    status = fence_check.check(list(fence_check.FENCES), out=report)
    assert status == 0, report.getvalue()
    assert f"{len(fence_check.FENCES)} of {len(fence_check.FENCES)} fences caught" in report.getvalue()
