"""Declarative job files (``chimes apply``, ``chimes export``): read and validate one, and work out
what applying it to an owner's jobs would change. Pure functions: no clock, no I/O.

A file is YAML (or JSON) with an optional ``owner`` and a list of ``jobs``, each a ``POST /jobs``
body plus an optional ``paused``. Jobs are matched to the owner's by ``name``; the API lets an owner
have two jobs of one name, and a file naming such a pair is refused, since apply could not tell
which one it describes.

Secret values (``task.secretHeaders``, ``task.secretEnv``) never read back: the API shows them as
``********``. So they are compared by name only; a value is sent when the job is created, when its
task changes otherwise, or with ``update_secrets``. ``********`` in a file keeps the stored value,
and ``${NAME}`` is replaced by the environment variable NAME, so files in Git need hold no secret.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from chimes.api.errors import field_path
from chimes.calendars import CALENDAR_NAME, CalendarSpec
from chimes.client.models import Job
from chimes.jobs import JobSpec
from chimes.security.secrets import REDACTED

SECRET_FIELDS = ("secretHeaders", "secretEnv")
FILE_KEYS = {"owner", "calendars", "jobs"}
ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# What each task type needs; everything else in an exported task is left out when it is the default.
REQUIRED_TASK_FIELDS = {"http": ("type", "url"), "command": ("type", "argv"), "container": ("type", "image")}


class JobFileError(Exception):
    """A file that cannot be applied; ``problems`` lists every one found, each naming job and field."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


@dataclass(frozen=True)
class FileJob:
    name: str
    where: str     # "job 'nightly' (jobs[2])", for messages
    wire: dict[str, Any]  # the definition as the API takes it, defaults filled in, secrets as given
    paused: bool | None   # None: the file leaves pausing to whoever operates the job


@dataclass(frozen=True)
class JobFile:
    owner: str | None
    jobs: list[FileJob]
    # The exclusion calendars the jobs name, by name, as PUT /calendars/{name} takes them: applied
    # before the jobs, so that a job may name a calendar the same file makes.
    calendars: dict[str, dict[str, Any]] = field(default_factory=dict)


def load(text: str, source: str, environ: Mapping[str, str] | None = None) -> JobFile:
    """Parse and validate a whole file; :class:`JobFileError` with every problem, or the jobs."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise JobFileError([f"{source}: not valid YAML: {exc}"]) from None
    if not isinstance(document, dict) or not isinstance(document.get("jobs"), list):
        raise JobFileError([f"{source}: must be a mapping with a list of `jobs` (and optionally `owner`)"])
    problems = [f"{source}: unknown key {key!r} (a file has `owner`, `calendars` and `jobs`)"
                for key in document if key not in FILE_KEYS]
    calendars = _calendars(document.get("calendars") or {}, source, problems)
    owner = document.get("owner")
    if owner is not None and not isinstance(owner, str):
        problems.append(f"{source}: owner: must be a team name")
    jobs: list[FileJob] = []
    seen: dict[str, str] = {}
    for index, item in enumerate(document["jobs"]):
        job = _job(item, index, source, os.environ if environ is None else environ, problems)
        if job is None:
            continue
        if job.name in seen:
            problems.append(f"{source}: {job.where}: name: {seen[job.name]} has the same name; names must be unique")
        seen[job.name] = job.where
        jobs.append(job)
    if problems:
        raise JobFileError(problems)
    return JobFile(owner, jobs, calendars)


def _calendars(given: Any, source: str, problems: list[str]) -> dict[str, dict[str, Any]]:
    if not isinstance(given, dict):
        problems.append(f"{source}: calendars: must be a mapping of names to calendars")
        return {}
    calendars = {}
    for name, item in given.items():
        if not isinstance(name, str) or not re.fullmatch(CALENDAR_NAME, name):
            problems.append(f"{source}: calendars: {name!r} is not a calendar name (letters, digits, _ . -)")
            continue
        try:
            calendars[name] = CalendarSpec.model_validate(item).to_wire()
        except ValidationError as exc:
            for error in exc.errors():
                text = str(error.get("msg", "invalid")).removeprefix("Value error, ")
                problems.append(f"{source}: calendars.{name}: {field_path(error.get('loc', ()))}: {text}")
    return calendars


def _job(item: Any, index: int, source: str, environ: Mapping[str, str], problems: list[str]) -> FileJob | None:
    name = item.get("name") if isinstance(item, dict) else None
    where = f"job {name!r} (jobs[{index}])" if isinstance(name, str) else f"jobs[{index}]"
    if not isinstance(item, dict):
        problems.append(f"{source}: {where}: must be a mapping (a job definition)")
        return None
    definition = dict(item)
    paused = definition.pop("paused", None)
    if paused is not None and not isinstance(paused, bool):
        problems.append(f"{source}: {where}: paused: must be true or false")
    task = definition.get("task")
    if isinstance(task, dict):
        definition["task"] = _expand_secrets(task, environ, lambda m: problems.append(f"{source}: {where}: {m}"))
    try:
        spec = JobSpec.model_validate(definition)
    except ValidationError as exc:
        for error in exc.errors():
            text = str(error.get("msg", "invalid")).removeprefix("Value error, ")
            if error.get("type") == "extra_forbidden":
                text = "unknown field"
            problems.append(f"{source}: {where}: {field_path(error.get('loc', ()))}: {text}")
        return None
    return FileJob(spec.name, where, spec.to_wire(), paused)


def _expand_secrets(task: dict[str, Any], environ: Mapping[str, str], problem: Any) -> dict[str, Any]:
    expanded = dict(task)
    for secret_field in SECRET_FIELDS:
        values = task.get(secret_field)
        if not isinstance(values, dict):
            continue
        expanded[secret_field] = {}
        for name, value in values.items():
            reference = ENV_REFERENCE.fullmatch(value) if isinstance(value, str) else None
            if reference and reference.group(1) not in environ:
                problem(f"task.{secret_field}.{name}: the environment variable {reference.group(1)} is not set")
            expanded[secret_field][name] = environ.get(reference.group(1), "") if reference else value
    return expanded


# ----------------------------------------------------------------------------------------------- plan

Action = Literal["create", "update", "delete", "unchanged"]


@dataclass(frozen=True)
class Change:
    action: Action
    name: str
    job_id: str | None = None
    version: int | None = None  # the version the change was computed from: sent as If-Match
    body: dict[str, Any] = field(default_factory=dict)  # POST body (create) or PATCH body (update)
    diff: list[str] = field(default_factory=list)  # "schedule.cron: '0 2 * * *' -> '0 3 * * *'"
    pause: bool = False  # create: pause the new job right after


def plan(file: JobFile, current: Sequence[Job], *, prune: bool = False, update_secrets: bool = False,
         source: str = "the file") -> list[Change]:
    """What applying ``file`` to ``current`` (the owner's jobs) changes: a :class:`Change` per file
    job, in file order, then a delete per job the file does not name when ``prune``. Raises
    :class:`JobFileError` when the file cannot be applied as it stands."""
    by_name: dict[str, list[Job]] = {}
    for job in current:
        by_name.setdefault(job.name, []).append(job)
    problems, changes = [], []
    for wanted in file.jobs:
        matches = by_name.get(wanted.name, [])
        if len(matches) > 1:
            ids = ", ".join(j.job_id for j in matches)
            problems.append(f"{source}: {wanted.where}: name: {len(matches)} jobs of this owner are named "
                            f"{wanted.name!r} ({ids}): rename or delete all but one, then apply again")
        elif not matches:
            problems += [f"{source}: {wanted.where}: {p}" for p in _placeholders(wanted.wire)]
            changes.append(Change("create", wanted.name, body=wanted.wire, pause=bool(wanted.paused)))
        else:
            changes.append(_update(wanted, matches[0], update_secrets))
    if problems:
        raise JobFileError(problems)
    if prune:
        named = {job.name for job in file.jobs}
        changes += [Change("delete", job.name, job.job_id, job.version) for job in current if job.name not in named]
    return changes


def _update(wanted: FileJob, job: Job, update_secrets: bool) -> Change:
    have = job.spec().to_wire()
    body: dict[str, Any] = {}
    diff: list[str] = []
    for key in [*wanted.wire, *(k for k in have if k not in wanted.wire)]:
        old, new = _masked(have).get(key), _masked(wanted.wire).get(key)
        rotate = key == "task" and update_secrets and _has_secret_values(wanted.wire)
        if old != new or rotate:
            body[key] = wanted.wire.get(key)  # None clears a field the file no longer sets (notifyUrl)
            diff += _differences(key, old, new) or [f"{key}: secret values sent"]
    if wanted.paused is not None and wanted.paused != job.paused:
        body["paused"] = wanted.paused
        diff.append(f"paused: {_show(job.paused)} -> {_show(wanted.paused)}")
    return Change("update" if body else "unchanged", wanted.name, job.job_id, job.version, body, diff)


def _masked(wire: Mapping[str, Any]) -> dict[str, Any]:
    """The definition with every secret value as ********: what can be compared with the API's."""
    task = wire.get("task")
    if not isinstance(task, dict):
        return dict(wire)
    masked = {k: dict.fromkeys(v, REDACTED) if k in SECRET_FIELDS and isinstance(v, dict) else v
              for k, v in task.items()}
    return {**wire, "task": masked}


def _has_secret_values(wire: Mapping[str, Any]) -> bool:
    task = wire.get("task") or {}
    return any(value != REDACTED for f in SECRET_FIELDS for value in (task.get(f) or {}).values())


def _placeholders(wire: Mapping[str, Any]) -> list[str]:
    task = wire.get("task") or {}
    return [f"task.{f}.{name}: {REDACTED} keeps a stored value, but this job does not exist yet: give the value "
            "(or ${VARIABLE} to take it from the environment)"
            for f in SECRET_FIELDS for name, value in (task.get(f) or {}).items() if value == REDACTED]


def _differences(path: str, old: Any, new: Any) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [line for key in sorted(set(old) | set(new))
                for line in _differences(f"{path}.{key}", old.get(key), new.get(key))]
    return [] if old == new else [f"{path}: {_show(old)} -> {_show(new)}"]


def _show(value: Any) -> str:
    return "(none)" if value is None else json.dumps(value, ensure_ascii=False)


# --------------------------------------------------------------------------------------------- export


def export(owner: str, jobs: Sequence[Job]) -> dict[str, Any]:
    """The document ``chimes apply`` takes, for these jobs: each definition without the fields left at
    their defaults, secret values as ********, ``paused: true`` for a paused job."""
    return {"owner": owner, "jobs": [_exported(job) for job in jobs]}


def _exported(job: Job) -> dict[str, Any]:
    wire = job.spec().to_wire()
    schedule = {k: wire["schedule"][k] for k in ("cron", "everySec", "at") if k in wire["schedule"]}
    task = {k: wire["task"][k] for k in REQUIRED_TASK_FIELDS.get(wire["task"].get("type"), ("type",))
            if k in wire["task"]}
    baseline = JobSpec.model_validate({"name": job.name, "schedule": schedule, "task": task}).to_wire()
    kept = _without_defaults(wire, baseline)
    kept["schedule"] = schedule | kept["schedule"]  # what the baseline was made of is never a default
    kept["task"] = task | kept["task"]
    if job.paused:
        kept["paused"] = True
    return kept


def _without_defaults(value: dict[str, Any], default: dict[str, Any]) -> dict[str, Any]:
    kept = {}
    for key, item in value.items():
        if key == "name" or key not in default:
            kept[key] = item
        elif isinstance(item, dict) and isinstance(default[key], dict):
            inner = _without_defaults(item, default[key])
            if inner or key in ("schedule", "task"):
                kept[key] = inner
        elif item != default[key]:
            kept[key] = item
    return kept


def dump_yaml(document: dict[str, Any]) -> str:
    header = ("# Jobs for `chimes apply -f FILE`, written by `chimes export`. Secret values read back as\n"
              f"# {REDACTED}: apply keeps the stored value of each (or write ${{NAME}}: an environment variable).\n")
    return header + yaml.safe_dump(document, sort_keys=False, allow_unicode=True, width=120)
