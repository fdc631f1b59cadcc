"""Proves that every fence in Chimes's SQL has a deterministic test that fails without it.

    python -m tests.fence_check            # every fence, two mutants at a time (docs/benchmarks.md gives its time)
    python -m tests.fence_check --list     # the fences, their tests, and the clauses found not to be fences
    python -m tests.fence_check complete   # only the fences whose name contains "complete"

For each fence below, the check copies the package (``src/chimes``) into a temporary folder,
neutralises the fence's clause there (``X`` becomes ``(X OR true)``: the statement keeps its
parameters and their types, and the condition no longer holds anything back), and runs the fence's
tests against that copy (``PYTHONPATH`` puts it before the installed package). A fence counts as
guarded only if at least one of its tests fails, and not on an error of the mutated SQL itself.
The working tree is never touched. The tests first run once against an unchanged copy: they must
pass there. A clause whose text is no longer found, exactly once, in its statement fails the check,
so the list cannot drift from the SQL. Exit status 1 on any of these.

The tests reuse one PostgreSQL for every run: ``CHIMES_DATABASE_URL`` when set (as in
``tests/integration/test_fence_check.py``), otherwise an embedded server started for the check.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "chimes"
FENCES_TESTS = "tests/integration/test_fences.py"
FENCING_TESTS = "tests/integration/test_fencing.py"
MUTANTS_AT_ONCE = 2  # mutated copies tested at once (check())


@dataclass(frozen=True)
class Fence:
    """A condition (or conditions that stand in for each other) in one statement, and its tests."""

    name: str
    file: str  # under src/chimes/store
    statement: str  # a "-- name:" block of sql/*.sql
    clauses: tuple[str, ...]  # each found exactly once in the statement; removed together
    tests: tuple[str, ...]  # node ids
    race: str


def t(*names: str) -> tuple[str, ...]:
    return tuple(name if "::" in name else f"{FENCES_TESTS}::{name}" for name in names)


OWNER = "the caller's owner (team-b asks for team-a's)"

FENCES: tuple[Fence, ...] = (
    # --- partition lease -----------------------------------------------------------------------
    Fence("fire: partition lease token", "sql/scheduling.sql", "fire_triggers", ("l.token = held.token",),
          t("test_fire_fence_partition_token", "test_retry_fence_partition_token"),
          "a batch prepared before the node lost its partitions and took them back (same owner, new token)"),
    Fence("fire: partition lease owner and expiry", "sql/scheduling.sql", "fire_triggers",
          ("l.owner = $node_id", "l.expires_at > now()"), t("test_fire_fence_released_partition"),
          "a batch prepared before a clean release, which keeps the token"),
    Fence("fire: partition lease owner", "sql/scheduling.sql", "fire_triggers", ("l.owner = $node_id",),
          t("test_fire_fence_a_token_issued_again_to_another_node"),
          "a token issued again, to another node, by a promoted standby that had not received the first issue "
          "(asynchronous replication; docs/high-availability.md)"),
    Fence("fire: the database's clock", "sql/scheduling.sql", "fire_triggers",
          ("b.fire_at <= (SELECT now FROM moment)",),
          t("tests/integration/test_clock_skew.py::test_the_database_refuses_what_a_fast_node_sends_early"),
          "a node whose clock runs ahead sends triggers before their time"),
    Fence("reap: partition lease token", "sql/scheduling.sql", "reap_runs", ("l.token = held.token",),
          t("test_reap_fence_partition_token", f"{FENCING_TESTS}::test_reaper_refuses_without_lease"),
          "a reap prepared before the node lost its partitions and took them back"),
    Fence("reap: partition lease owner and expiry", "sql/scheduling.sql", "reap_runs",
          ("l.owner = $node_id", "l.expires_at > now()"), t("test_reap_fence_released_partition"),
          "a reap prepared before a clean release"),
    Fence("renew: partition lease token and owner", "sql/scheduling.sql", "renew_leases",
          ("l.token = held.token", "l.owner = $1"), t(f"{FENCING_TESTS}::test_renewal_fails_after_takeover"),
          "a node renews after another took its partitions over"),
    Fence("release: partition lease owner", "sql/scheduling.sql", "release_leases", ("owner = $1",),
          t("test_release_leases_fence_owner"), "a node that lost its partitions leaves"),
    # --- job version ---------------------------------------------------------------------------
    Fence("fire: trigger version", "sql/scheduling.sql", "fire_triggers", ("t.job_version = d.job_version",),
          t("test_fire_fence_trigger_version"),
          "an edit rewrote the trigger under the same key after the node read it"),
    Fence("fire: job version", "sql/scheduling.sql", "fire_triggers",
          ("f.job_version >= coalesce(j.plan_version, j.version)",),
          t("test_fire_fence_job_version", f"{FENCING_TESTS}::test_stale_trigger_left_by_a_race_fires_nothing"),
          "an edit racing a fire left the fire's next trigger behind at the old version"),
    # --- run lease -----------------------------------------------------------------------------
    Fence("complete: run lease token", "sql/working.sql", "complete_runs", ("r.lease_token = o.lease_token",),
          t("test_complete_fence_run_lease_token", "test_complete_fence_run_lease_token_for_a_retry"),
          "lease expires, reaper re-enqueues, a second worker claims, the first reports"),
    Fence("complete: lease row token", "sql/working.sql", "complete_runs", ("l.token = o.lease_token",),
          t("test_complete_fence_run_lease_token", "test_complete_fence_run_lease_token_for_a_retry"),
          "the same race: the first worker's report must not delete the second worker's own lease row"),
    Fence("extend: run lease token", "sql/working.sql", "extend_leases", ("l.token = held.lease_token",),
          t("test_extend_fence_run_lease_token"),
          "the first worker heartbeats after a second claimed the run (a run with a lease of its own)"),
    Fence("heartbeat: runs still held", "sql/working.sql", "runs_still_running",
          ("r.lease_token = held.lease_token",), t("test_extend_fence_run_lease_token"),
          "the same race: the first worker's heartbeat must tell it the run is gone, so that it stops it"),
    Fence("release: run lease token", "sql/working.sql", "release_runs", ("r.lease_token = held.lease_token",),
          t("test_release_fence_run_lease_token"), "the first worker shuts down after a second claimed the run"),
    Fence("release: lease row token", "sql/working.sql", "release_runs", ("l.token = held.lease_token",),
          t("test_release_fence_run_lease_token"),
          "the same race: the first worker's release must not delete the second worker's lease row"),
    Fence("reap: run lease token", "sql/scheduling.sql", "reap_runs", ("l.token = d.lease_token",),
          t("test_reap_fence_run_lease_token"),
          "the reaper's judgement of one attempt arrives after the run was claimed again and expired again"
          " (a run with a lease of its own)"),
    Fence("reap: run token", "sql/scheduling.sql", "reap_runs", ("r.lease_token = d.lease_token",),
          t("test_reap_fence_run_lease_token"),
          "the reaper's judgement of one attempt arrives after the run was claimed again and expired again"),
    Fence("reap: lease still expired", "sql/scheduling.sql", "reap_runs",
          ("(l.expires_at < now() OR l.deadline_at < now())",), t("test_reap_fence_lease_still_expired"),
          "the worker, paused and not dead, renewed its lease between the reaper's read and write"),
    Fence("reap: claim's lease still expired", "sql/scheduling.sql", "reap_runs",
          ("(c.expires_at < now() OR u.deadline_at < now())",), t("test_reap_fence_lease_still_expired"),
          "the same race, for a run that shares its claim's lease"),
    Fence("claim: run still waiting", "sql/working.sql", "claim_runs",
          ("r.status = 'scheduled'",), t("test_claim_fence_run_still_scheduled"),
          "a cancel racing a retry's fire leaves a queue row for the cancelled run"),
    Fence("callback heartbeat: run lease token", "sql/runs.sql", "callback_heartbeat", ("l.token = $4",),
          t("test_callback_heartbeat_fence_run_lease_token"),
          "the target of attempt 1 heartbeats after the run was claimed again"),
    Fence("callback heartbeat: run token", "sql/runs.sql", "callback_own_lease", ("r.lease_token = $4",),
          t("test_callback_heartbeat_fence_run_lease_token"),
          "the same race, for a run that shared its claim's lease until its target's first heartbeat"),
    # --- owner ---------------------------------------------------------------------------------
    Fence("callback heartbeat: owner", "sql/runs.sql", "callback_heartbeat", ("($3::text IS NULL OR r.owner = $3)",),
          t("test_owner_fence_callback_heartbeat"), OWNER),
    Fence("callback heartbeat, first: owner", "sql/runs.sql", "callback_own_lease",
          ("($3::text IS NULL OR r.owner = $3)",), t("test_owner_fence_callback_heartbeat"), OWNER),
    Fence("callback complete: owner", "sql/runs.sql", "running_with_token",
          ("($3::text IS NULL OR r.owner = $3)",), t("test_owner_fence_callback_complete"), OWNER),
    Fence("list runs: owner", "sql/runs.sql", "list_runs", ("($2::text IS NULL OR owner = $2)",),
          t("test_owner_fence_list_runs"), OWNER),
    Fence("get run: owner", "sql/runs.sql", "get_run", ("($3::text IS NULL OR owner = $3)",),
          t("test_owner_fence_get_run"), OWNER),
    Fence("job visible: owner", "sql/runs.sql", "job_owner", ("($2::text IS NULL OR owner = $2)",),
          t("test_owner_fence_job_owner"), OWNER),
    Fence("run now / re-run: owner", "sql/runs.sql", "start_run_now", ("($2::text IS NULL OR owner = $2)",),
          t("test_owner_fence_start_run_now"), OWNER),
    Fence("cancel: owner", "sql/runs.sql", "cancel_run", ("($3::text IS NULL OR owner = $3)",),
          t("test_owner_fence_cancel_run"), OWNER),
    Fence("backfill: owner", "sql/runs.sql", "job_for_backfill", ("($2::text IS NULL OR owner = $2)",),
          t("test_owner_fence_backfill"), OWNER),
    Fence("get job: owner", "sql/jobs.sql", "get_job", ("($2::text IS NULL OR j.owner = $2)",),
          t("test_owner_fence_get_job"), OWNER),
    Fence("update / pause / resume job: owner", "sql/jobs.sql", "lock_job", ("($2::text IS NULL OR j.owner = $2)",),
          t("test_owner_fence_lock_job"), OWNER),
    Fence("delete job: owner", "sql/jobs.sql", "delete_job", ("($2::text IS NULL OR owner = $2)",),
          t("test_owner_fence_delete_job"), OWNER),
    Fence("list jobs: owner", "sql/jobs.sql", "list_jobs", ("j.owner = $1",), t("test_owner_fence_list_jobs"),
          OWNER),
    Fence("idempotency key: owner", "sql/jobs.sql", "job_by_idempotency_key", ("owner = $1",),
          t("test_owner_fence_idempotency_key"), "two teams use the same Idempotency-Key"),
    Fence("dashboard jobs: owner", "sql/dashboard.sql", "dashboard_jobs_of_owner", ("j.owner = $1",),
          t("test_owner_fence_dashboard_jobs"), OWNER),
    Fence("dashboard paused jobs: owner", "sql/dashboard.sql", "dashboard_paused_jobs",
          ("($1::text IS NULL OR j.owner = $1)",), t("test_owner_fence_dashboard_paused_jobs"), OWNER),
    Fence("dashboard failing jobs: owner", "sql/dashboard.sql", "dashboard_failing_jobs",
          ("($1::text IS NULL OR r.owner = $1)",), t("test_owner_fence_dashboard_failing_jobs"), OWNER),
    Fence("dashboard runs in flight: owner", "sql/dashboard.sql", "dashboard_running_runs",
          ("($1::text IS NULL OR r.owner = $1)",), t("test_owner_fence_dashboard_running_runs"), OWNER),
    Fence("dashboard failures per minute: owner", "sql/dashboard.sql", "dashboard_failures_per_minute",
          ("($2::text IS NULL OR r.owner = $2)",), t("test_owner_fence_dashboard_failures_per_minute"), OWNER),
    # --- owner: calendars and the audit trail ----------------------------------------------------
    Fence("calendar get: owner", "sql/calendars.sql", "get_calendar", ("owner = $1",),
          t("test_owner_fence_get_calendar"), OWNER),
    Fence("calendar list: owner", "sql/calendars.sql", "list_calendars", ("($1::text IS NULL OR owner = $1)",),
          t("test_owner_fence_list_calendars"), OWNER),
    Fence("calendars of a page's jobs: owner", "sql/calendars.sql", "calendars_of_owners",
          ("owner = ANY($1::text[])",), t("test_owner_fence_calendars_of_owners"),
          "team-b's job names a calendar by the name of one of team-a's (previews, nextRunAt, backfill)"),
    Fence("calendars a node reads again: owner", "sql/calendars.sql", "calendars_by_key", ("c.owner = k.owner",),
          t("test_owner_fence_calendars_by_key"), "team-b's calendar and team-a's have the same name"),
    Fence("calendar delete: owner", "sql/calendars.sql", "delete_calendar", ("owner = $1",),
          t("test_owner_fence_delete_calendar"), OWNER),
    Fence("calendar delete's lock: owner", "sql/calendars.sql", "lock_calendar", ("owner = $1",),
          t("test_owner_fence_lock_calendar"), OWNER),
    Fence("calendars a job names: owner", "sql/calendars.sql", "missing_calendars", ("c.owner = $1",),
          t("test_owner_fence_missing_calendars"), "team-b's job names a calendar only team-a has"),
    Fence("calendars a job being written locks: owner", "sql/calendars.sql", "share_calendars", ("owner = $1",),
          t("test_owner_fence_share_calendars"),
          "team-b writes a job naming a calendar while team-a deletes its own of that name"),
    Fence("jobs that hold a calendar: owner", "sql/calendars.sql", "jobs_using_calendar", ("owner = $1",),
          t("test_owner_fence_jobs_using_calendar"),
          "team-a deletes its calendar while team-b's job names team-b's of that name"),
    Fence("audit entries: owner", "sql/audit.sql", "list_audit_entries", ("subject_owner = $3",),
          t("test_owner_fence_audit_entries"), OWNER),
    Fence("audit entries: an owner's jobs and calendars only", "sql/audit.sql", "list_audit_entries",
          ("(job_id IS NOT NULL OR action LIKE 'calendar.%')",), t("test_owner_fence_audit_entries_of_operators"),
          "an operator changed team-a's settings (owner.update, caps): the entry names team-a, the admins list it"),
)

# Conditions that look like fences but hold nothing back on their own; docs/reliability.md says why.
NOT_FENCES: tuple[tuple[str, str, str, str], ...] = (
    ("sql/working.sql", "complete_runs", "r.status = 'running'",
     "every way out of running (complete, reap, release, cancel) clears lease_token, so the token implies it"),
    ("sql/working.sql", "release_runs", "r.status = 'running'", "implied by the lease token, as above"),
    ("sql/scheduling.sql", "reap_runs", "r.status = 'running'", "implied by the lease token, as above"),
    ("sql/runs.sql", "running_with_token", "r.lease_token = $4",
     "complete_runs checks the same token in the same transaction"),
    ("sql/scheduling.sql", "fire_triggers", "NOT j.paused",
     "a pause raises the version and removes the trigger in one transaction: the version check covers it"),
    ("sql/scheduling.sql", "fire_triggers", "r.status = 'scheduled'",
     "a cancel removes the retry trigger in its own transaction; the race that slips past is closed at claim"),
    ("sql/dashboard.sql", "dashboard_jobs_of_all", "($1::text IS NULL)",
     "the dashboard picks this statement only for admins"),
)


def statement_span(text: str, statement: str) -> tuple[int, int]:
    """Where the named statement is in the file's text."""
    match = re.search(rf"^--\s*name:\s*{re.escape(statement)}\s*$", text, re.MULTILINE)
    start = match.start() if match else -1
    following = re.compile(r"^--\s*name:", re.MULTILINE).search(text, start + 1) if match else None
    end = following.start() if following else len(text)
    if start < 0:
        raise LookupError(f"statement {statement} not found")
    return start, end


def mutate(text: str, statement: str, clauses: tuple[str, ...]) -> str:
    """The file's text with each clause of the statement made always true."""
    start, end = statement_span(text, statement)
    body = text[start:end]
    for clause in clauses:
        count = body.count(clause)
        if count != 1:
            raise LookupError(f"{statement}: {clause!r} found {count} times, expected once")
        body = body.replace(clause, f"({clause} OR true)")
    return text[:start] + body + text[end:]


def stale_entries() -> list[str]:
    """Fences and non-fences whose clause is no longer in their statement exactly once."""
    problems = []
    entries = [(f.file, f.statement, f.clauses) for f in FENCES] + [(n[0], n[1], (n[2],)) for n in NOT_FENCES]
    for file, statement, clauses in entries:
        try:
            mutate((PACKAGE / "store" / file).read_text(), statement, clauses)
        except LookupError as exc:
            problems.append(f"{file}: {exc}")
    return problems


def database_url() -> contextlib.AbstractContextManager[str]:
    from chimes.store.embedded import server_for_a_while

    return server_for_a_while("chimes-fence-pg-")


_BROKEN_SQL = re.compile(r"PostgresSyntaxError|UndefinedParameterError|IndeterminateDatatypeError|"
                         r"UndefinedColumnError|UndefinedFunctionError|AmbiguousParameterError")


@dataclass
class Outcome:
    failed: dict[str, str]  # node id -> the failure's one-line reason
    passed: int
    output: str
    seconds: float


def run_tests(copy: Path, tests: tuple[str, ...], dsn: str) -> Outcome:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(copy), str(ROOT)]), CHIMES_DATABASE_URL=dsn, COLUMNS="200")
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", "--no-header", *tests],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    failed = {}
    for line in proc.stdout.splitlines():
        if line.startswith("FAILED "):
            node, _, reason = line.removeprefix("FAILED ").partition(" - ")
            failed[node] = reason
    passed = re.search(r"(\d+) passed", proc.stdout)
    return Outcome(failed, int(passed.group(1)) if passed else 0, proc.stdout + proc.stderr,
                   time.monotonic() - started)


def fresh_copy(into: Path) -> Path:
    if into.exists():
        shutil.rmtree(into)
    shutil.copytree(PACKAGE, into / "chimes", ignore=shutil.ignore_patterns("__pycache__"))
    return into


def check(selected: list[Fence], out=sys.stdout) -> int:
    def say(line: str) -> None:
        print(line, file=out, flush=True)

    problems = stale_entries()
    for problem in problems:
        say(f"STALE    {problem}")
    if problems:
        say("the list of fences no longer matches the SQL: fix tests/fence_check.py")
        return 1
    started = time.monotonic()
    missed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="chimes-fence-") as work, database_url() as dsn:
        copy = fresh_copy(Path(work) / "src")
        probe = subprocess.run([sys.executable, "-c", "import chimes; print(chimes.__file__)"], cwd=ROOT,
                               env=dict(os.environ, PYTHONPATH=str(copy)), capture_output=True, text=True,
                               check=True).stdout.strip()
        if not probe.startswith(str(copy)):
            say(f"the copy is not what the tests import ({probe}): cannot check")
            return 1
        every_test = tuple(dict.fromkeys(test for fence in selected for test in fence.tests))
        baseline = run_tests(copy, every_test, dsn)
        # A test parametrized over the two kinds of run lease is one node id and passes twice.
        if baseline.failed or baseline.passed < len(every_test) or re.search(r"\d+ (error|skipped)", baseline.output):
            say(baseline.output[-4000:])
            say(f"BASELINE the fences' tests do not all pass on the unchanged SQL "
                f"({baseline.passed} of {len(every_test)} passed): nothing to prove")
            return 1
        say(f"baseline: {len(every_test)} tests pass on the unchanged SQL ({baseline.seconds:.1f} s)")

        def without(numbered: tuple[int, Fence]) -> Outcome:
            number, fence = numbered
            copy = fresh_copy(Path(work) / f"mutant-{number}")
            path = copy / "chimes" / "store" / fence.file
            path.write_text(mutate(path.read_text(), fence.statement, fence.clauses))
            return run_tests(copy, fence.tests, dsn)

        # Two mutants at a time: most of a pytest run is starting the interpreter and waiting on the
        # database, so two share two cores well (each copy is its own folder, each test its own
        # database); the report keeps the fences' order.
        with concurrent.futures.ThreadPoolExecutor(max_workers=MUTANTS_AT_ONCE) as pool:
            outcomes = list(pool.map(without, enumerate(selected)))
        for fence, outcome in zip(selected, outcomes, strict=True):
            noticed = {node: why for node, why in outcome.failed.items() if not _BROKEN_SQL.search(why)}
            broken = {node: why for node, why in outcome.failed.items() if _BROKEN_SQL.search(why)}
            removed = " + ".join(fence.clauses)
            if noticed:
                node, why = next(iter(noticed.items()))
                ran = len(outcome.failed) + outcome.passed  # a parametrized test runs once per parameter
                say(f"caught   {fence.name}: without `{removed}` {len(noticed)}/{ran} failed "
                    f"({outcome.seconds:.1f} s), e.g. {node.rpartition('::')[2]}: {why[:90]}")
            else:
                missed.append(fence.name)
                detail = f"the mutated SQL broke instead: {next(iter(broken.values()))}" if broken else \
                    "every test passed"
                say(f"MISSED   {fence.name}: without `{removed}` {detail}")
    say(f"{len(selected) - len(missed)} of {len(selected)} fences caught, {len(missed)} missed, "
        f"in {time.monotonic() - started:.0f} s")
    return 1 if missed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fence_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="only the fences whose name contains one of these")
    parser.add_argument("--list", action="store_true", help="list the fences and their tests, run nothing")
    args = parser.parse_args(argv)
    selected = [f for f in FENCES if not args.names or any(n in f.name for n in args.names)]
    if args.list:
        for fence in FENCES:
            print(f"{fence.name}\n  {fence.file} {fence.statement}: {' + '.join(fence.clauses)}\n"
                  f"  race: {fence.race}\n  " + "\n  ".join(fence.tests))
        print("\nnot fences on their own:")
        for file, statement, clause, why in NOT_FENCES:
            print(f"  {file} {statement}: {clause}\n    {why}")
        problems = stale_entries()
        for problem in problems:
            print(f"STALE    {problem}")
        return 1 if problems else 0
    if not selected:
        parser.error("no fence matches")
    return check(selected)


if __name__ == "__main__":
    sys.exit(main())
