"""The small closed sets of values Chimes stores: a run's status and trigger, a queue tier, a trigger kind.

The values are what the database holds (the ``runs_status``, ``runs_trigger`` and ``jobs_priority``
CHECK constraints, the ``triggers.kind`` column) and what the SQL in ``store/sql/*.sql`` writes as
literals; ``tests/unit/test_enums.py`` and ``tests/integration/test_enums_in_sql.py`` fail when the
two drift apart. A member compares equal to its value (``IntEnum``/``StrEnum``), so it can be passed
to asyncpg and compared with what a row holds as it is.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum

__all__ = ["Priority", "RunStatus", "RunTrigger", "TriggerKind"]


class Priority(IntEnum):
    """A job's queue tier (``jobs.priority``, copied to ``runs.priority``): lower is claimed first.

    The API names a tier by its lower-case member name (``"high"``, ``"normal"``, ``"batch"``).
    """

    HIGH = 0
    NORMAL = 1
    BATCH = 2

    @property
    def label(self) -> str:
        """The name the API and the CLI use: ``high``, ``normal`` or ``batch``."""
        return self.name.lower()

    @classmethod
    def from_label(cls, label: str) -> Priority:
        """The tier the API calls ``label``; ``KeyError`` for a name that is none."""
        return cls[label.upper()]


class TriggerKind(IntEnum):
    """What a row of ``triggers`` is: the next fire of a job's schedule, or a run waiting to be retried.

    A schedule trigger's ``trigger_id`` is the job id; a retry trigger's is the run id.
    """

    SCHEDULE = 0
    RETRY = 1


class RunStatus(StrEnum):
    """Where a run is (``runs.status``).

    ``scheduled``: waiting for its time or a worker; ``running``: held by a worker under a lease (or
    accepted by its target, which reports itself); the other four are final.
    """

    SCHEDULED = "scheduled"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"
    CANCELLED = "cancelled"


class RunTrigger(StrEnum):
    """Why a run exists (``runs.trigger``)."""

    SCHEDULE = "schedule"  # its job's schedule came due
    MANUAL = "manual"  # started now through the API or the dashboard
    RERUN = "rerun"  # a new run of a finished one
    CATCHUP = "catchup"  # a slot missed while nothing ran, made up by the job's catch-up policy
