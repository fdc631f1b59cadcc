"""The enums say what the SQL writes: every literal status, tier and trigger kind in the statements
(``store/sql/*.sql``) and the migrations is a member's value, so the two cannot drift apart unseen.
The CHECK constraints themselves are compared with the enums on a real database
(``tests/integration/test_enums_in_sql.py``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import chimes.store.queries
from chimes.api import openapi, runs
from chimes.enums import Priority, RunStatus, RunTrigger, TriggerKind
from chimes.jobs import JobSpec

STORE = Path(chimes.store.queries.__file__).parent
SQL = sorted([*STORE.glob("sql/*.sql"), *STORE.glob("migrations/*.sql")])
STATUSES = {str(status) for status in RunStatus}


def statements() -> str:
    text = "\n".join(path.read_text() for path in SQL)
    return re.sub(r"--[^\n]*", "", text)  # comments may say anything


def quoted(text: str) -> set[str]:
    return set(re.findall(r"'([^']*)'", text))


def test_every_status_the_sql_compares_or_writes_is_a_run_status() -> None:
    sql = statements()
    found: set[str] = set()
    found |= set(re.findall(r"\bstatus\s*(?:=|<>|!=)\s*'(\w+)'", sql))
    for listed in re.findall(r"\bstatus\s+IN\s*\(([^)]*)\)", sql):
        found |= quoted(listed)
    for case in re.findall(r"\bstatus\s*=\s*CASE\b(.*?)\bEND\b", sql, flags=re.S):
        found |= quoted(case)
    found |= set(re.findall(r"\bstatus\s+text\s+NOT NULL\s+DEFAULT\s+'(\w+)'", sql))
    assert {"scheduled", "running", "failed", "cancelled", "skipped"} <= found, "the scan finds the statements"
    assert found <= STATUSES, f"statuses in the SQL that RunStatus lacks: {found - STATUSES}"


def test_every_trigger_kind_the_sql_compares_or_writes_is_a_trigger_kind() -> None:
    sql = statements()
    compared = {int(n) for n in re.findall(r"\bkind\s*=\s*(\d+)", sql)}
    written = set()
    # The kind is the last value of the VALUES list or of the SELECT list, before FROM or ON CONFLICT.
    for insert in re.findall(r"INSERT INTO triggers\s*\([^)]*\bkind\)\s*(?:VALUES\s*\(|SELECT\b)(.*?)"
                             r"(?:\bFROM\b|\bON CONFLICT\b|;|$)", sql, flags=re.S):
        last = insert.rsplit(",", 1)[-1].strip().rstrip(")").strip()
        if last.isdigit():
            written.add(int(last))
    assert compared == {0, 1} and written == {0, 1}, "the scan finds both kinds, compared and written"
    assert compared | written <= {int(kind) for kind in TriggerKind}
    assert TriggerKind.SCHEDULE == 0 and TriggerKind.RETRY == 1  # the stored values


def test_the_api_names_the_same_tiers_statuses_and_triggers() -> None:
    assert set(get_args(JobSpec.model_fields["priority"].annotation)) == {tier.label for tier in Priority}
    assert {Priority.from_label(tier.label) for tier in Priority} == set(Priority)
    assert set(get_args(runs.RunStatus)) == STATUSES
    assert set(get_args(openapi.RunStatus)) == STATUSES
    assert "'catchup'" in statements() and RunTrigger.CATCHUP == "catchup"
