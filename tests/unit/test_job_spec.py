"""Tests for chimes.jobs (JobSpec, JobPatch) and chimes.api.errors.field_path."""

from __future__ import annotations

import typing
from datetime import UTC, datetime

import orjson
import pydantic
import pytest

from chimes import jobs
from chimes.api.errors import field_path
from chimes.cli.importer import parse_line
from chimes.jobs import AtScheduleSpec, CronScheduleSpec, JobPatch, JobSpec

BASE = {"name": "nightly", "schedule": {"cron": "0 3 * * *", "timezone": "Europe/Berlin"},
        "task": {"type": "http", "url": "https://example.com/hook"}}


def spec(**overrides: object) -> JobSpec:
    return JobSpec.model_validate({**BASE, **overrides})


@pytest.mark.parametrize(
    ("loc", "expected"),
    [
        (("body", "task", "http", "url"), "task.url"),
        (("body", "task", "command", "argv", 0), "task.argv.0"),
        (("body", "schedule", "cron", "cron"), "schedule.cron"),
        (("body", "schedule", "at", "at"), "schedule.at"),
        (("body", "schedule", "cron"), "schedule"),
        (("body", "retryPolicy", "maxAttempts"), "retryPolicy.maxAttempts"),
        (("query", "limit"), "limit"),
        (("path", "job_id"), "job_id"),
        (("body",), "body"),
        ((), "body"),
    ],
)
def test_field_path(loc: tuple, expected: str) -> None:
    assert field_path(loc) == expected


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"task": {"type": "http", "url": "ftp://x"}}, "task.url"),
        ({"schedule": {"cron": "61 * * * *"}}, "schedule.cron"),
        ({"schedule": {"at": "2026-01-01T00:00:00"}}, "schedule.at"),  # no offset
        ({"timeoutSec": 0}, "timeoutSec"),
    ],
)
def test_field_path_of_real_validation_errors(overrides: dict, expected: str) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        spec(**overrides)
    assert [field_path(e["loc"]) for e in info.value.errors()] == [expected]


def test_defaults() -> None:
    s = spec()
    assert s.retry_policy.max_attempts == 3
    assert s.timeout_sec == 3600
    assert s.concurrency == "skip"
    assert s.priority == "normal"
    assert s.is_recurring
    assert isinstance(s.schedule, CronScheduleSpec)


def test_at_is_truncated_to_millis() -> None:
    s = spec(schedule={"at": "2026-12-01T09:00:00.123456+02:00"})
    assert isinstance(s.schedule, AtScheduleSpec)
    assert not s.is_recurring
    assert s.schedule.at == datetime(2026, 12, 1, 7, 0, 0, 123000, tzinfo=UTC)
    assert s.schedule.at.microsecond == 123000


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"schedule": {"at": "2026-12-01T09:00:00.5Z"}},
        {"task": {"type": "command", "argv": ["echo", "hi"], "env": {"A": "1"}, "cwd": "/tmp"}},
        {"task": {"type": "container", "image": "busybox", "command": ["true"]}},
        {"task": {"type": "http", "url": "http://x", "body": {"a": None, "b": [1, None]}},
         "retryPolicy": {"maxAttempts": 5, "jitter": 0}, "timeoutSec": 60, "priority": "high"},
    ],
)
def test_to_wire_round_trips(overrides: dict) -> None:
    s = spec(**overrides)
    again = JobSpec.model_validate(s.to_wire())
    assert again == s
    assert again.to_wire() == s.to_wire()
    assert again.fingerprint() == s.fingerprint()


def test_fingerprint_equal_for_equal_specs_and_different_otherwise() -> None:
    assert spec().fingerprint() == spec().fingerprint()
    # the default spelled out is the same definition
    assert spec(timeoutSec=3600, schedule={**BASE["schedule"], "jitterSec": 0}).fingerprint() == spec().fingerprint()
    variants = [spec(), spec(name="other"), spec(timeoutSec=61), spec(priority="batch"),
                spec(schedule={"cron": "0 3 * * *"}), spec(task={"type": "http", "url": "https://example.com/x"})]
    assert len({v.fingerprint() for v in variants}) == len(variants)


def test_patch_name_keeps_the_rest() -> None:
    current = spec(timeoutSec=120, priority="high")
    patched = JobPatch.model_validate({"name": "renamed"}).apply_to(current)
    assert patched.name == "renamed"
    assert patched.model_dump(exclude={"name"}) == current.model_dump(exclude={"name"})


def test_patch_replaces_schedule_wholly() -> None:
    patched = JobPatch.model_validate({"schedule": {"cron": "*/10 * * * *"}}).apply_to(spec())
    assert patched.schedule == CronScheduleSpec(cron="*/10 * * * *")
    assert patched.schedule.timezone == "UTC"  # not merged with the old Europe/Berlin
    to_once = JobPatch.model_validate({"schedule": {"at": "2027-01-01T00:00:00Z"}}).apply_to(spec())
    assert not to_once.is_recurring


def test_patch_paused_only_changes_nothing() -> None:
    assert JobPatch.model_validate({"paused": True}).apply_to(spec()) == spec()


@pytest.mark.parametrize(
    "patch",
    [
        {"timeoutSec": 0},
        {"schedule": {"cron": "not a cron"}},
        {"schedule": {"cron": "* * * * *", "at": "2027-01-01T00:00:00Z"}},
        {"priority": "urgent"},
        {"retryPolicy": {"initialBackoffSec": 10, "maxBackoffSec": 5}},
        {"name": ""},
    ],
)
def test_invalid_patch_raises(patch: dict) -> None:
    with pytest.raises(pydantic.ValidationError):
        JobPatch.model_validate(patch).apply_to(spec())


def test_unknown_patch_field_is_rejected() -> None:
    with pytest.raises(pydantic.ValidationError):
        JobPatch.model_validate({"nmae": "typo"})


def _holds_text(annotation: object) -> bool:
    if annotation is str or annotation is typing.Any:
        return True
    if typing.get_origin(annotation) is typing.Literal:  # its values are checked against a fixed set
        return False
    return any(_holds_text(arg) for arg in typing.get_args(annotation))


def _checked_fields(model: type[pydantic.BaseModel]) -> set[str]:
    validators = model.__pydantic_decorators__.field_validators.values()
    named = {name for v in validators if v.func.__name__ == "_refuse_unstorable" for name in v.info.fields}
    return set(model.model_fields) if "*" in named else named


@pytest.mark.parametrize("model", [m for m in vars(jobs).values()
                                   if isinstance(m, type) and issubclass(m, jobs._Model) and m is not jobs._Model])
def test_every_field_that_can_hold_text_is_checked_for_storability(model: type[pydantic.BaseModel]) -> None:
    text_fields = {name for name, field in model.model_fields.items() if _holds_text(field.annotation)}
    unchecked = text_fields - _checked_fields(model)
    assert not unchecked, f"{model.__name__}: fields not checked for storability: {sorted(unchecked)}"


@pytest.mark.parametrize("field", ["headers", "secretHeaders"])
@pytest.mark.parametrize("name", ["X-Chimes-Run-Id", "x-chimes-signature", "X-CHIMES-ANYTHING"])
def test_a_header_of_chimes_own_is_refused_on_every_path_that_validates_a_job(field: str, name: str) -> None:
    """The API, ``chimes apply`` and ``chimes jobs import`` validate through JobSpec; a PATCH validates
    the patched definition the same way (JobPatch.apply_to)."""
    task = {**BASE["task"], field: {name: "forged"}}
    with pytest.raises(pydantic.ValidationError, match="X-Chimes-\\* headers are Chimes' own"):
        spec(task=task)
    with pytest.raises(pydantic.ValidationError, match="X-Chimes-\\* headers are Chimes' own"):
        JobPatch.model_validate({"task": task}).apply_to(spec())
    line = orjson.dumps({**BASE, "task": task})
    assert parse_line(line) == (f"task.{field}: header {name!r} may not be set by a task: X-Chimes-* headers are "
                                "Chimes' own (the run's id, attempt, time, signature and lease token), which it "
                                "sets on every call")
