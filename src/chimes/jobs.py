"""A job definition as users write it, validated: the one place that decides what a valid job is.

The API, the CLI and the bulk importer all validate through :class:`JobSpec`, so a job that exists
in the database was always accepted by the same rules.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Annotated, Any, Literal, get_args

import orjson
from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from chimes import cron, schedules
from chimes.calendars import CALENDAR_NAME
from chimes.cron import CronSchedule
from chimes.ids import schedulable, truncate_to_millis
from chimes.security.headers import HEADER_NAME, forbidden_header, header_value_problem, reserved_header
from chimes.security.ssrf import request_url_problem, url_problem
from chimes.security.storable import storable_problem
from chimes.settings import CATCH_UP_WINDOW_SEC, RUN_TIMEOUT_SEC

MAX_TIMEOUT_SEC = 7 * 24 * 3600
MAX_RUNS = 1_000_000_000


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


def _refuse_unstorable(cls: type, value: Any) -> Any:
    problem = storable_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def _refuse_uncallable(cls: type, value: str | None) -> str | None:
    problem = None if value is None else url_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def callable_url(*fields: str) -> Any:
    """Refuse a URL no call can ever be made to (an unclosed IPv6 bracket, a port past 65535, a host
    that decodes to what no host name holds: chimes.security.ssrf.outgoing_url), which would fail
    every attempt."""
    return field_validator(*fields)(_refuse_uncallable)


def _refuse_unsendable(cls: type, value: str) -> str:
    problem = request_url_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def storable(*fields: str) -> Any:
    """Refuse valid JSON that PostgreSQL or a target could not take (NUL, lone surrogates, deep
    nesting) in the named fields: those that can hold text. Numbers, booleans, literals and nested
    models need no check, and each checked field costs a call into Python per job (tests/unit/
    test_job_spec.py makes sure no text field is left out)."""
    return field_validator(*fields)(_refuse_unstorable)


def _bound_millis(cls: type, value: datetime | None, info: ValidationInfo) -> datetime | None:
    if value is None:
        return None
    schedulable(value)
    value = truncate_to_millis(value)
    start = info.data.get("start_at")  # validated first: declared first
    if info.field_name == "end_at" and start is not None and value <= start:
        raise ValueError(f"must be after startAt ({start.isoformat()})")
    return value


ExcludeCalendars = Annotated[list[Annotated[str, Field(pattern=CALENDAR_NAME)]] | None, Field(max_length=20)]


class _RecurringScheduleSpec(_Model):
    """What every recurring schedule may have besides its rule: bounds, a run cap, calendars."""

    start_at: AwareDatetime | None = Field(default=None, alias="startAt")
    end_at: AwareDatetime | None = Field(default=None, alias="endAt")
    # Stop after this many slots (docs/semantics.md, "Run cap").
    max_runs: Annotated[int | None, Field(alias="maxRuns", ge=1, le=MAX_RUNS)] = None
    # Named calendars of the owner's whose days and windows the job does not run in (chimes.calendars).
    exclude_calendars: ExcludeCalendars = Field(default=None, alias="excludeCalendars")

    _text = storable("exclude_calendars")
    _bounds = field_validator("start_at", "end_at")(_bound_millis)


class CronScheduleSpec(_RecurringScheduleSpec):
    cron: Annotated[str, Field(min_length=1, max_length=200)]
    timezone: Annotated[str, Field(min_length=1, max_length=64)] = "UTC"
    jitter_sec: Annotated[int, Field(alias="jitterSec", ge=0, le=3600)] = 0
    # DST policy (cron.py): None follows cron's customs; see docs/semantics.md.
    dst_gap: Literal["shift", "skip"] | None = Field(default=None, alias="dstGap")
    dst_fold: Literal["first", "last", "both"] | None = Field(default=None, alias="dstFold")

    _text = storable("cron", "timezone", "exclude_calendars")

    @field_validator("cron")
    @classmethod
    def _valid_cron(cls, value: str) -> str:
        cron.validate_cron(value, "UTC")
        return value

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        cron.parse_timezone(value)
        return value

    @model_validator(mode="after")
    def _fires_in_its_zone(self) -> CronScheduleSpec:
        """The cron field alone was checked in UTC; in a zone with `dstGap: skip` a wall time can be
        skipped every year (02:30 on the second Sunday of March in New York). Named as the cron
        field's error, like every other expression that never fires. Only an explicit skip can drop
        every wall time (no standing rule has a gap of a whole day), so other specs, nearly all of a
        bulk import, pay nothing more."""
        if self.dst_gap != "skip":
            return self
        try:
            cron.validate_cron(self.cron, self.timezone, dst_gap=self.dst_gap, dst_fold=self.dst_fold)
        except cron.CronError as error:
            raise ValidationError.from_exception_data(type(self).__name__, [InitErrorDetails(
                type=PydanticCustomError("value_error", str(error)), loc=("cron",), input=self.cron)]) from None
        return self

    def as_cron(self) -> CronSchedule:  # not cron.CronSchedule: in the class, `cron` is the field
        return cron.CronSchedule(self.cron, self.timezone, self.dst_gap, self.dst_fold)

    def recurrence(self) -> schedules.Recurrence:
        return schedules.Recurrence(self.as_cron(), self.start_at, self.end_at)


class IntervalScheduleSpec(_RecurringScheduleSpec):
    """Every ``everySec`` seconds at ``phaseSec`` past each multiple of it since the epoch (chimes.schedules).
    ``every`` and ``phase`` take the same as durations (``90m``, ``15m``); the stored form is in seconds."""

    every_sec: Annotated[int, Field(alias="everySec", ge=schedules.MIN_INTERVAL_SEC, le=schedules.MAX_INTERVAL_SEC)]
    phase_sec: Annotated[int, Field(alias="phaseSec", ge=0, lt=schedules.MAX_INTERVAL_SEC)] = 0
    jitter_sec: Annotated[int, Field(alias="jitterSec", ge=0, le=3600)] = 0

    @model_validator(mode="before")
    @classmethod
    def _durations(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        value = dict(value)
        for text_key, seconds_key in (("every", "everySec"), ("phase", "phaseSec")):
            if text_key not in value:
                continue
            if seconds_key in value:
                raise ValueError(f"give either '{text_key}' or '{seconds_key}', not both")
            text = value.pop(text_key)
            try:
                value[seconds_key] = schedules.parse_duration(text)
            except schedules.ScheduleError as exc:
                raise ValueError(f"{text_key}: {exc}") from None
        return value

    @field_validator("phase_sec")
    @classmethod
    def _phase_within(cls, value: int, info: ValidationInfo) -> int:
        every = info.data.get("every_sec")
        if every is not None and value >= every:
            raise ValueError(f"must be less than everySec ({every}): the fires are everySec apart, "
                             "phaseSec past each multiple of it since the epoch")
        return value

    def recurrence(self) -> schedules.Recurrence:
        return schedules.Recurrence(schedules.IntervalSchedule(self.every_sec, self.phase_sec),
                                    self.start_at, self.end_at)


class AtScheduleSpec(_Model):
    at: AwareDatetime

    @field_validator("at")
    @classmethod
    def _millis(cls, value: datetime) -> datetime:
        schedulable(value)
        return truncate_to_millis(value)


HttpMethod = Literal["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
HTTP_TASK_METHODS = frozenset(get_args(HttpMethod))


class HttpTaskSpec(_Model):
    type: Literal["http"]
    url: Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^https?://")]
    method: HttpMethod = "POST"
    headers: dict[Annotated[str, Field(min_length=1, max_length=256, pattern=rf"^{HEADER_NAME}$")],
                  Annotated[str, Field(max_length=8192)]] = Field(default_factory=dict, max_length=100)
    body: Any = None
    # The target answers 202 and reports the outcome itself through the callback endpoints.
    callback: bool = False
    # Sealed at rest, never shown again, opened by the worker right before the call (docs/security.md).
    secret_headers: dict[Annotated[str, Field(min_length=1, max_length=256, pattern=rf"^{HEADER_NAME}$")],
                         Annotated[str, Field(max_length=8192)]] | None = Field(
        default=None, alias="secretHeaders", max_length=100)

    _text = storable("url", "headers", "body", "secret_headers")
    # What callable_url refuses, and user info (user:password@), which the job would hold in plain text
    # (chimes.security.ssrf.outgoing_request).
    _url = field_validator("url")(_refuse_unsendable)

    @field_validator("headers", "secret_headers")
    @classmethod
    def _no_header_injection(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        # Framing and connection headers are the HTTP client's: set by a task, they can smuggle a
        # request into the next one on a kept-alive connection (chimes.security.headers).
        for name, header in (value or {}).items():
            if reserved_header(name):
                raise ValueError(f"header {name!r} may not be set by a task: X-Chimes-* headers are Chimes' own "
                                 "(the run's id, attempt, time, signature and lease token), which it sets on "
                                 "every call")
            if forbidden_header(name):
                raise ValueError(f"header {name!r} may not be set by a task: Chimes sets the framing, connection "
                                 "and host headers itself (Content-Length, Transfer-Encoding, Connection, "
                                 "Keep-Alive, TE, Trailer, Upgrade, Expect, Host, Proxy-*)")
            problem = header_value_problem(header)
            if problem is not None:
                raise ValueError(f"header {name!r} {problem}")
        return value

    @model_validator(mode="after")
    def _secret_names_distinct(self) -> HttpTaskSpec:
        _no_overlap({k.lower() for k in self.headers}, {k.lower() for k in self.secret_headers or {}}, "header")
        return self


SecretEnv = dict[Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")],
                 Annotated[str, Field(max_length=32768)]] | None


def _no_overlap(plain: set[str], secret: set[str], what: str) -> None:
    both = sorted(plain & secret)
    if both:
        raise ValueError(f"{what} {both[0]!r} is given both as a plain and as a secret value")


class CommandTaskSpec(_Model):
    type: Literal["command"]
    argv: Annotated[list[Annotated[str, Field(max_length=8192)]], Field(min_length=1, max_length=1000)]
    env: dict[Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")],
              Annotated[str, Field(max_length=32768)]] = Field(default_factory=dict, max_length=500)
    cwd: Annotated[str, Field(max_length=4096)] | None = None
    secret_env: SecretEnv = Field(default=None, alias="secretEnv", max_length=500)

    _text = storable("argv", "env", "cwd", "secret_env")

    @model_validator(mode="after")
    def _secret_names_distinct(self) -> CommandTaskSpec:
        _no_overlap(set(self.env), set(self.secret_env or {}), "variable")
        return self


class ContainerTaskSpec(_Model):
    type: Literal["container"]
    image: Annotated[str, Field(min_length=1, max_length=512)]
    command: list[Annotated[str, Field(max_length=8192)]] = Field(default_factory=list, max_length=1000)
    env: dict[Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")],
              Annotated[str, Field(max_length=32768)]] = Field(default_factory=dict, max_length=500)
    secret_env: SecretEnv = Field(default=None, alias="secretEnv", max_length=500)

    _text = storable("image", "command", "env", "secret_env")

    @field_validator("env", "secret_env")
    @classmethod
    def _single_line_values(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        # The worker hands them to the runtime in an env file (off the process list): one line each.
        for name, text in (value or {}).items():
            if "\n" in text or "\r" in text:
                raise ValueError(f"variable {name!r} contains a line break; container env values are single "
                                 "lines (encode longer values, for example in base64)")
        return value

    @model_validator(mode="after")
    def _secret_names_distinct(self) -> ContainerTaskSpec:
        _no_overlap(set(self.env), set(self.secret_env or {}), "variable")
        return self


TaskSpec = Annotated[HttpTaskSpec | CommandTaskSpec | ContainerTaskSpec, Field(discriminator="type")]


_INTERVAL_KEYS = ("every", "everySec", "every_sec")


def _schedule_kind(value: Any) -> str:
    if isinstance(value, dict):
        if "at" in value:
            return "at"
        return "interval" if any(key in value for key in _INTERVAL_KEYS) else "cron"
    if isinstance(value, AtScheduleSpec):
        return "at"
    return "interval" if isinstance(value, IntervalScheduleSpec) else "cron"


ScheduleSpec = Annotated[
    Annotated[CronScheduleSpec, Tag("cron")] | Annotated[IntervalScheduleSpec, Tag("interval")]
    | Annotated[AtScheduleSpec, Tag("at")],
    Discriminator(_schedule_kind),
]
# Union members that pydantic names in error locations; errors read better without them.
UNION_TAGS = {"schedule": {"cron", "interval", "at"}, "task": {"http", "command", "container"}}


class RetryPolicy(_Model):
    max_attempts: Annotated[int, Field(alias="maxAttempts", ge=1, le=100)] = 3
    initial_backoff_sec: Annotated[float, Field(alias="initialBackoffSec", gt=0, le=86400)] = 1.0
    max_backoff_sec: Annotated[float, Field(alias="maxBackoffSec", gt=0, le=7 * 86400)] = 300.0
    multiplier: Annotated[float, Field(ge=1, le=100)] = 2.0
    jitter: Annotated[float, Field(ge=0, le=1)] = 0.2
    # The overall deadline of a run's attempts, counted from its scheduledAt: no attempt starts later.
    max_duration_sec: Annotated[float | None, Field(alias="maxDurationSec", gt=0, le=366 * 86400)] = None

    @model_validator(mode="after")
    def _ordered(self) -> RetryPolicy:
        if self.max_backoff_sec < self.initial_backoff_sec:
            raise ValueError("maxBackoffSec must be at least initialBackoffSec")
        return self


class CatchUpPolicy(_Model):
    """What happens to fires missed while the scheduler was down or the job was paused."""

    policy: Literal["one", "all", "none"] = "one"
    max_runs: Annotated[int, Field(alias="maxRuns", ge=1, le=1000)] = 10
    window_sec: Annotated[int, Field(alias="windowSec", ge=1, le=366 * 86400)] = CATCH_UP_WINDOW_SEC


#: The events of a job's runs its webhook can be told of (``notifyOn``).
RunEvent = Literal["failed", "succeeded", "started"]
DEFAULT_NOTIFY_ON: tuple[RunEvent, ...] = ("failed",)

JobTag = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:/-]*$")]


class JobSpec(_Model):
    """Everything a user defines about a job. Field names on the wire are camelCase (API.md)."""

    name: Annotated[str, Field(min_length=1, max_length=200)]
    schedule: ScheduleSpec
    task: TaskSpec
    retry_policy: RetryPolicy = Field(default_factory=RetryPolicy, alias="retryPolicy")
    timeout_sec: Annotated[int, Field(alias="timeoutSec", ge=1, le=MAX_TIMEOUT_SEC)] = RUN_TIMEOUT_SEC
    # What a slot does while an earlier run is active (docs/semantics.md): replace cancels that run.
    concurrency: Literal["skip", "queue", "allow", "replace"] = "skip"
    queue_limit: Annotated[int, Field(alias="queueLimit", ge=1, le=1000)] = 10
    priority: Literal["high", "normal", "batch"] = "normal"
    catch_up: CatchUpPolicy = Field(default_factory=CatchUpPolicy, alias="catchUp")
    tags: Annotated[list[JobTag], Field(max_length=20)] = Field(default_factory=list)
    notify_url: Annotated[str | None, Field(alias="notifyUrl", max_length=4096, pattern=r"^https?://")] = None
    # A run waiting longer than this for a worker raises the same notification as a final failure.
    start_deadline_sec: Annotated[int, Field(alias="startDeadlineSec", ge=1, le=7 * 86400)] = 300
    # The job pauses itself when this many consecutive runs failed for good (after their retries).
    pause_after_failures: Annotated[int | None, Field(alias="pauseAfterFailures", ge=1, le=1000)] = None
    # A one-off job deletes itself once its run ended for good (docs/semantics.md); its runs stay.
    delete_after_completion: bool = Field(default=False, alias="deleteAfterCompletion")
    # Which of its runs' events go to the webhook; "failed" alone is the default, as before it existed.
    notify_on: Annotated[list[RunEvent], Field(alias="notifyOn", max_length=3)] = Field(
        default_factory=lambda: list(DEFAULT_NOTIFY_ON), alias="notifyOn")

    _text = storable("name", "tags", "notify_url")
    _url = callable_url("notify_url")

    @field_validator("notify_on")
    @classmethod
    def _each_event_once(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("name each event once")
        return value

    @field_validator("delete_after_completion")
    @classmethod
    def _one_offs_only(cls, value: bool, info: ValidationInfo) -> bool:
        if value and "schedule" in info.data and not isinstance(info.data["schedule"], AtScheduleSpec):
            raise ValueError("only a one-off job (schedule 'at') can delete itself after its run")
        return value

    @field_validator("schedule", mode="before")
    @classmethod
    def _one_schedule_kind(cls, value: Any) -> Any:
        if isinstance(value, dict):
            kinds = ("cron" in value) + ("at" in value) + any(key in value for key in _INTERVAL_KEYS)
            if kinds != 1:
                raise ValueError("give exactly one of 'cron' or 'every' (recurring) or 'at' (one-off)")
        return value

    @property
    def is_recurring(self) -> bool:
        return not isinstance(self.schedule, AtScheduleSpec)

    def to_wire(self) -> dict[str, Any]:
        wire = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        # Left out at their defaults, as before they existed: the same definition, the same fingerprint.
        if not self.delete_after_completion:
            del wire["deleteAfterCompletion"]
        if self.notify_on == list(DEFAULT_NOTIFY_ON):
            del wire["notifyOn"]
        return wire

    def fingerprint(self) -> bytes:
        """A stable hash of the definition, to tell an idempotent retry from a different request."""
        return hashlib.sha256(orjson.dumps(self.to_wire(), option=orjson.OPT_SORT_KEYS)).digest()


class JobPatch(_Model):
    """A partial update: every field optional; ``paused`` pauses or resumes."""

    name: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    schedule: dict[str, Any] | None = None
    task: dict[str, Any] | None = None
    retry_policy: dict[str, Any] | None = Field(default=None, alias="retryPolicy")
    timeout_sec: int | None = Field(default=None, alias="timeoutSec")
    concurrency: str | None = None
    queue_limit: int | None = Field(default=None, alias="queueLimit")
    priority: str | None = None
    catch_up: dict[str, Any] | None = Field(default=None, alias="catchUp")
    tags: list[str] | None = None
    notify_url: str | None = Field(default=None, alias="notifyUrl")
    start_deadline_sec: int | None = Field(default=None, alias="startDeadlineSec")
    pause_after_failures: int | None = Field(default=None, alias="pauseAfterFailures")
    delete_after_completion: bool | None = Field(default=None, alias="deleteAfterCompletion")
    notify_on: list[str] | None = Field(default=None, alias="notifyOn")
    paused: bool | None = None
    # Why the job is paused, recorded with the pause and who asked for it (after ``paused``: read below).
    pause_note: Annotated[str | None, Field(alias="pauseNote", max_length=1000)] = None

    _text = storable("*")

    @field_validator("pause_note")
    @classmethod
    def _note_with_a_pause(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("paused") is not True:
            raise ValueError("a pauseNote is given with \"paused\": true (it says why the job is paused)")
        return value

    def apply_to(self, current: JobSpec) -> JobSpec:
        """The full definition after this patch, validated by the same rules as a create."""
        merged = current.to_wire()
        merged.update(self.model_dump(by_alias=True, exclude_unset=True, exclude={"paused", "pause_note"}))
        return JobSpec.model_validate(merged)
