"""``chimes apply`` and ``chimes export`` through the real API: create, re-apply changes nothing,
one changed field is one update, prune, dry run, export round trip, bad files, secrets kept."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner, Result

from chimes.cli.main import cli
from chimes.client import AsyncClient
from tests.helpers import Homes

JOBS = """
owner: team-a
jobs:
  - name: nightly-report
    schedule: {cron: "0 2 * * *", timezone: Europe/Berlin}
    task: {type: http, url: "http://127.0.0.1:9/reports", body: {full: true}}
    retryPolicy: {maxAttempts: 5}
    tags: [reports]
  - name: hourly-sync
    schedule: {cron: "@hourly"}
    task:
      type: http
      method: PUT
      url: http://127.0.0.1:9/sync
      headers: {X-Team: data}
      secretHeaders: {Authorization: "${SYNC_TOKEN}"}
    timeoutSec: 120
"""


def write(path: Path, text: str) -> None:
    path.write_text(text)


async def chimes(url: str, token: str, *args: str, env: dict[str, str] | None = None) -> Result:
    environment = {"CHIMES_TOKEN": token, "CHIMES_API_URL": url, "COLUMNS": "200", **(env or {})}
    return await asyncio.to_thread(CliRunner().invoke, cli, list(args), env=environment)


async def apply(url: str, token: str, path: Path, *options: str) -> Result:
    return await chimes(url, token, "apply", "-f", str(path), *options, env={"SYNC_TOKEN": "Bearer s3cret"})


async def versions(url: str, token: str) -> dict[str, int]:
    async with AsyncClient(url, token) as client:
        return {job.name: job.version async for job in client.jobs.list()}


@pytest.fixture
def jobs_file(tmp_path: Path) -> Path:
    path = tmp_path / "jobs.yaml"
    write(path, JOBS)
    return path


async def sealed(homes: Homes, name: str) -> str:
    [task] = [r["task"] for r in await homes.fetch("SELECT task FROM jobs WHERE name = $1", name)]
    return (json.loads(task) if isinstance(task, str) else task)["secretHeaders"]["Authorization"]


async def test_apply_creates_then_changes_nothing_then_one_update(
    api_url: str, tokens: dict[str, str], jobs_file: Path, homes: Homes
) -> None:
    token = tokens["team-a"]
    first = await apply(api_url, token, jobs_file)
    assert first.exit_code == 0, first.output
    assert "create    nightly-report" in first.output and "create    hourly-sync" in first.output
    assert "applied: 2 created, 0 updated, 0 deleted, 0 unchanged" in first.output
    before, secret = await versions(api_url, token), await sealed(homes, "hourly-sync")
    assert before == {"nightly-report": 1, "hourly-sync": 1}

    again = await apply(api_url, token, jobs_file)
    assert again.exit_code == 0, again.output
    assert "applied: 0 created, 0 updated, 0 deleted, 2 unchanged" in again.output
    assert await versions(api_url, token) == before and await sealed(homes, "hourly-sync") == secret

    write(jobs_file, JOBS.replace("maxAttempts: 5", "maxAttempts: 7"))
    changed = await apply(api_url, token, jobs_file)
    assert changed.exit_code == 0, changed.output
    assert "retryPolicy.maxAttempts: 5 -> 7" in changed.output
    assert "applied: 0 created, 1 updated, 0 deleted, 1 unchanged" in changed.output
    assert await versions(api_url, token) == {"nightly-report": 2, "hourly-sync": 1}

    # Another change to the task keeps the secret: the file's value is sent again with it.
    write(jobs_file, JOBS.replace("maxAttempts: 5", "maxAttempts: 7").replace("X-Team: data", "X-Team: ops"))
    assert (await apply(api_url, token, jobs_file)).exit_code == 0
    async with AsyncClient(api_url, token) as client:
        [sync] = [job async for job in client.jobs.list() if job.name == "hourly-sync"]
    assert sync.task.headers == {"X-Team": "ops"} and sync.task.secret_headers == {"Authorization": "********"}


async def test_dry_run_and_prune(api_url: str, tokens: dict[str, str], jobs_file: Path) -> None:
    token = tokens["team-a"]
    assert (await apply(api_url, token, jobs_file)).exit_code == 0
    before = await versions(api_url, token)
    only_one = JOBS[: JOBS.index("  - name: hourly-sync")].replace("@hourly", "x")
    write(jobs_file, only_one.replace('"0 2 * * *"', '"0 3 * * *"'))

    dry = await apply(api_url, token, jobs_file, "--prune", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert 'schedule.cron: "0 2 * * *" -> "0 3 * * *"' in dry.output
    assert "delete    hourly-sync" in dry.output
    assert "dry run: 0 to create, 1 to update, 1 to delete, 0 unchanged; nothing was changed" in dry.output
    assert await versions(api_url, token) == before

    kept = await apply(api_url, token, jobs_file)  # without --prune, unlisted jobs stay
    assert "applied: 0 created, 1 updated, 0 deleted, 0 unchanged" in kept.output
    assert set(await versions(api_url, token)) == {"nightly-report", "hourly-sync"}
    pruned = await apply(api_url, token, jobs_file, "--prune")
    assert pruned.exit_code == 0, pruned.output
    assert "applied: 0 created, 0 updated, 1 deleted, 1 unchanged" in pruned.output
    assert await versions(api_url, token) == {"nightly-report": 2}


async def test_export_then_apply_is_a_no_op(api_url: str, tokens: dict[str, str], jobs_file: Path,
                                            tmp_path: Path, homes: Homes) -> None:
    token = tokens["team-a"]
    assert (await apply(api_url, token, jobs_file)).exit_code == 0
    async with AsyncClient(api_url, token) as client:
        await client.jobs.create({"name": "once", "schedule": {"at": "2030-01-01T09:00:00+01:00"},
                                  "task": {"type": "http", "url": "http://127.0.0.1:9/once"},
                                  "notifyUrl": "http://127.0.0.1:9/alerts", "catchUp": {"policy": "none"}})
        paused = await client.jobs.create({"name": "paused", "schedule": {"cron": "*/5 * * * *"},
                                           "task": {"type": "http", "url": "http://127.0.0.1:9/p"}})
        await client.jobs.pause(paused.job_id)
    before, secret = await versions(api_url, token), await sealed(homes, "hourly-sync")

    exported = await chimes(api_url, token, "export")
    assert exported.exit_code == 0, exported.output
    document = yaml.safe_load(exported.stdout)
    assert document["owner"] == "team-a"
    [sync] = [job for job in document["jobs"] if job["name"] == "hourly-sync"]
    assert sync["task"]["secretHeaders"] == {"Authorization": "********"}
    assert "retryPolicy" not in sync and sync["timeoutSec"] == 120  # defaults left out
    assert [job.get("paused") for job in document["jobs"]] == [None, None, None, True]
    for name, text in (("jobs.yaml", exported.stdout),
                       ("jobs.json", (await chimes(api_url, token, "export", "-o", "json")).stdout)):
        (tmp_path / name).write_text(text)
        again = await chimes(api_url, token, "apply", "-f", str(tmp_path / name), "--prune")
        assert again.exit_code == 0, again.output
        assert "applied: 0 created, 0 updated, 0 deleted, 4 unchanged" in again.output
    assert await versions(api_url, token) == before and await sealed(homes, "hourly-sync") == secret


async def test_a_bad_file_changes_nothing_and_names_job_and_field(
    api_url: str, tokens: dict[str, str], jobs_file: Path
) -> None:
    token = tokens["team-a"]
    assert (await apply(api_url, token, jobs_file)).exit_code == 0
    before = await versions(api_url, token)
    bad = JOBS.replace("maxAttempts: 5", "maxAttempts: 7") + """
  - name: broken
    schedule: {cron: "0 2 * * *", timezone: Mars/Base}
    task: {type: http, url: "http://127.0.0.1:9/x"}
    timeoutSecs: 5
"""
    write(jobs_file, bad)
    result = await apply(api_url, token, jobs_file, "--prune")
    assert result.exit_code == 1
    assert "job 'broken' (jobs[2]): schedule.timezone:" in result.stderr
    assert "job 'broken' (jobs[2]): timeoutSecs: unknown field" in result.stderr
    assert "nothing was changed" in result.stderr
    assert await versions(api_url, token) == before

    write(jobs_file, JOBS.replace("Europe/Berlin}", "Europe/Berlin"))
    assert "not valid YAML" in (await apply(api_url, token, jobs_file)).stderr
    write(jobs_file, JOBS)
    missing = await chimes(api_url, token, "apply", "-f", str(jobs_file))  # no SYNC_TOKEN in the environment
    assert missing.exit_code == 1
    assert "hourly-sync' (jobs[1]): task.secretHeaders.Authorization: the environment variable SYNC_TOKEN" in (
        missing.stderr)
    assert await versions(api_url, token) == before


async def test_duplicate_names_another_owner_and_admin_tokens(
    api_url: str, tokens: dict[str, str], jobs_file: Path
) -> None:
    job = {"schedule": {"cron": "@daily"}, "task": {"type": "http", "url": "http://127.0.0.1:9/x"}}
    async with AsyncClient(api_url, tokens["team-b"]) as team_b:
        await team_b.jobs.create({"name": "team-b's own", **job})
    # The file says team-a: another team's token is refused before anything is written.
    refused = await apply(api_url, tokens["team-b"], jobs_file, "--prune")
    assert refused.exit_code == 1 and "describes 'team-a''s jobs, but this token acts for 'team-b'" in refused.stderr
    # An admin token manages its own owner's jobs only: team-b's stay, even with --prune.
    write(jobs_file, JOBS.replace("owner: team-a\n", ""))
    assert (await apply(api_url, tokens["admin"], jobs_file, "--prune")).exit_code == 0
    assert set(await versions(api_url, tokens["team-b"])) == {"team-b's own"}
    assert set(await versions(api_url, tokens["admin"])) == {"team-b's own", "nightly-report", "hourly-sync"}

    async with AsyncClient(api_url, tokens["team-a"]) as team_a:
        for _ in range(2):
            await team_a.jobs.create({"name": "nightly-report", **job})
    twice = await apply(api_url, tokens["team-a"], jobs_file)
    assert twice.exit_code == 1
    assert "job 'nightly-report' (jobs[0]): name: 2 jobs of this owner are named 'nightly-report'" in twice.stderr
    assert set(await versions(api_url, tokens["team-a"])) == {"nightly-report"}


async def test_a_header_of_chimes_own_in_a_file_changes_nothing_and_names_job_and_field(
    api_url: str, tokens: dict[str, str], jobs_file: Path
) -> None:
    token = tokens["team-a"]
    assert (await apply(api_url, token, jobs_file)).exit_code == 0
    before = await versions(api_url, token)
    write(jobs_file, JOBS.replace("headers: {X-Team: data}", "headers: {X-Team: data, x-chimes-signature: forged}"))
    result = await apply(api_url, token, jobs_file)
    assert result.exit_code == 1
    assert ("job 'hourly-sync' (jobs[1]): task.headers: header 'x-chimes-signature' may not be set by a task"
            in result.stderr)
    assert await versions(api_url, token) == before
