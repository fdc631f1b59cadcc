"""The API's answers as typed objects. Attributes are the API's camelCase field names in snake_case
(``nextRunAt`` is ``next_run_at``); fields a newer API adds are kept (``extra="allow"``), and
``raw`` is the answer exactly as the API sent it, for printing or passing on.

A :class:`Job` is a :class:`chimes.jobs.JobSpec` (the definition, validated by the same rules as
the API's) plus what Chimes knows about it; secret values read back as ``"********"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date, datetime
from typing import Any, Generic, Self, TypeVar

from pydantic import AliasGenerator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError
from pydantic.alias_generators import to_camel

from chimes.client.errors import ChimesError
from chimes.jobs import JobSpec

# Fields of GET /jobs/{id} that the server adds; the rest is the job's definition.
JOB_METADATA = ("jobId", "owner", "paused", "pausedAt", "pausedBy", "pauseNote", "version", "nextRunAt", "createdAt",
                "updatedAt", "lastRun", "scheduleEnded", "nextRuns", "remainingRuns")
_CAMEL = AliasGenerator(validation_alias=to_camel, serialization_alias=to_camel)


class _FromApi(BaseModel):
    """Parsed from an answer with :meth:`from_api`, which keeps that answer in ``raw``."""

    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)

    @classmethod
    def from_api(cls, data: Any) -> Self:
        try:
            parsed = cls.model_validate(data)
        except ValidationError as exc:
            raise ChimesError(f"the API's answer is not a {cls.__name__}: {exc}") from None
        parsed._raw = data
        return parsed

    @property
    def raw(self) -> dict[str, Any]:
        """The answer exactly as the API sent it."""
        return self._raw


class Answer(_FromApi):
    """Something the API answered: typed fields, unknown ones kept."""

    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True, alias_generator=_CAMEL)


class LastRun(Answer):
    """The summary of a job's last run in ``GET /jobs``."""

    run_id: str | None = None
    status: str
    scheduled_at: datetime | None = None


class Job(JobSpec, _FromApi):
    """A job: its definition (the fields of :class:`~chimes.jobs.JobSpec`) and its state."""

    model_config = ConfigDict(extra="allow", frozen=True, populate_by_name=True)

    job_id: str = Field(alias="jobId")
    owner: str
    paused: bool
    # While paused: since when, who paused it (a token's name or owner; "chimes" for pauseAfterFailures), why.
    paused_at: datetime | None = Field(default=None, alias="pausedAt")
    paused_by: str | None = Field(default=None, alias="pausedBy")
    pause_note: str | None = Field(default=None, alias="pauseNote")
    version: int
    next_run_at: datetime | None = Field(alias="nextRunAt")
    created_at: datetime = Field(alias="createdAt")
    updated_at: datetime = Field(alias="updatedAt")
    last_run: LastRun | None = Field(default=None, alias="lastRun")
    #: Past its endAt: nothing is left to fire.
    schedule_ended: bool = Field(default=False, alias="scheduleEnded")
    #: The slots left to a job with a run cap (schedule.maxRuns); None without one.
    remaining_runs: int | None = Field(default=None, alias="remainingRuns")
    #: The next fire times, when asked for with ``jobs.get(job_id, preview=N)``.
    next_runs: list[datetime] | None = Field(default=None, alias="nextRuns")

    @property
    def definition(self) -> dict[str, Any]:
        """The job's definition as the API showed it: what ``POST /jobs`` took, defaults filled in."""
        return {k: v for k, v in self.raw.items() if k not in JOB_METADATA}

    def spec(self) -> JobSpec:
        """The definition alone, as a :class:`~chimes.jobs.JobSpec` (secret values as ``"********"``;
        fields this version of Chimes does not know are left out)."""
        known = {f.alias or name for name, f in JobSpec.model_fields.items()}
        return JobSpec.model_validate({k: v for k, v in self.definition.items() if k in known})


class Pause(Answer):
    """One pause of a job (``GET /jobs/{id}/pauses``); ``resumed_at`` None while it lasts."""

    paused_at: datetime
    paused_by: str
    note: str | None = None
    resumed_at: datetime | None = None
    resumed_by: str | None = None


class JobCreated(Answer):
    job_id: str
    next_run_at: datetime | None
    #: The new job's version (its ETag); None from an API that sends none.
    version: int | None = None
    #: False when an Idempotency-Key named a job created before: nothing new was made.
    created: bool = True


class Attempt(Answer):
    attempt: int
    worker_id: str | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    status: str
    error: str | None = None
    output: str | None = None


class Run(Answer):
    """A run; ``attempts`` is given by ``runs.get`` and ``runs.cancel``, not in lists."""

    run_id: str
    job_id: str
    scheduled_at: datetime
    fired_at: datetime | None = None
    status: str
    attempt: int
    trigger: str
    started_at: datetime | None = None
    finished_at: datetime | None = None
    error: str | None = None
    reason: str | None = None
    attempts: list[Attempt] | None = None


class Backfilled(Answer):
    run_ids: list[str]
    created: int
    existing: int
    skipped: int = 0  # slots a calendar of the job's excludes, recorded as skipped (0 from servers before it)


class Notification(Answer):
    notification_id: str
    job_id: str
    owner: str
    kind: str
    status: str
    url: str
    created_at: datetime
    attempts: int
    next_attempt_at: datetime | None = None
    sent_at: datetime | None = None
    dead_at: datetime | None = None
    last_error: str | None = None
    payload: Any = None


class Calendar(Answer):
    """An exclusion calendar (``/calendars``): days and windows, in ``timezone``, jobs do not run in."""

    name: str
    owner: str
    timezone: str
    dates: list[date]
    windows: list[dict[str, Any]]
    version: int
    updated_at: datetime


class Identity(Answer):
    """The calling token (``GET /whoami``)."""

    owner: str
    scope: str
    admin: bool


T = TypeVar("T")


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a list: its items, the cursor of the next page (None on the last), the raw answer."""

    items: list[T]
    next_cursor: str | None
    raw: dict[str, Any] = field(repr=False)


@dataclass(frozen=True)
class RunPage(Page[Run]):
    #: The job was deleted: its runs stay listable until retention removes them.
    job_deleted: bool = False
