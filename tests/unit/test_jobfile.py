"""Job files without a server: what a file may say, and the plan apply makes from it."""

from __future__ import annotations

from typing import Any

import pytest

from chimes.cli import jobfile
from chimes.client import Job

FILE = """
jobs:
  - name: sync
    schedule: {cron: "@hourly"}
    task: {type: http, url: "http://x.test/sync", secretHeaders: {Authorization: "%s"}}
"""


def job(**definition: Any) -> Job:
    return Job.from_api({
        "jobId": "j-1", "owner": "team-a", "name": "sync", "schedule": {"cron": "@hourly"},
        "task": {"type": "http", "url": "http://x.test/sync", "secretHeaders": {"Authorization": "********"}},
        "paused": False, "version": 3, "nextRunAt": None, "createdAt": "2026-01-01T00:00:00Z",
        "updatedAt": "2026-01-01T00:00:00Z", **definition,
    })


def test_secret_values_compare_by_name_and_are_sent_when_asked() -> None:
    given = jobfile.load(FILE % "${TOKEN}", "f.yaml", environ={"TOKEN": "Bearer abc"})
    [same] = jobfile.plan(given, [job()])
    assert same.action == "unchanged"
    [rotated] = jobfile.plan(given, [job()], update_secrets=True)
    assert rotated.action == "update" and rotated.version == 3
    assert rotated.body["task"]["secretHeaders"] == {"Authorization": "Bearer abc"}


def test_a_placeholder_cannot_create_a_job() -> None:
    given = jobfile.load(FILE % "********", "f.yaml")
    assert jobfile.plan(given, [job()])[0].action == "unchanged"  # keeps the stored value
    with pytest.raises(jobfile.JobFileError, match=r"job 'sync' \(jobs\[0\]\): task.secretHeaders.Authorization: "):
        jobfile.plan(given, [])


def test_a_field_the_file_drops_is_cleared() -> None:
    [change] = jobfile.plan(jobfile.load(FILE % "********", "f.yaml"), [job(notifyUrl="http://x.test/alerts")])
    assert change.body == {"notifyUrl": None}
    assert change.diff == ['notifyUrl: "http://x.test/alerts" -> (none)']


@pytest.mark.parametrize(("text", "problem"), [
    ("jobs: {}", "must be a mapping with a list of `jobs`"),
    ("jobs: []\nowners: x", "unknown key 'owners'"),
    (FILE % "x" + FILE.split("jobs:")[1] % "y", "job 'sync' (jobs[1]): name: job 'sync' (jobs[0]) has the same name"),
    ("jobs:\n  - name: a\n    paused: maybe", "job 'a' (jobs[0]): paused: must be true or false"),
    ("jobs:\n  - [1]", "jobs[0]: must be a mapping"),
])
def test_bad_files_name_the_job_and_field(text: str, problem: str) -> None:
    with pytest.raises(jobfile.JobFileError) as refused:
        jobfile.load(text, "f.yaml")
    assert any(problem in line for line in refused.value.problems), refused.value.problems
