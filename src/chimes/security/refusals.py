"""Refusals by policy, raised below the API and answered by it as JSON errors with a status."""

from __future__ import annotations


class Refused(Exception):
    """A request that the operator's policy refuses. The API answers ``status`` with ``code``,
    ``message`` and ``field`` (docs/api.md, "Errors"); nothing was written."""

    status = 403
    code = "forbidden"

    def __init__(self, message: str, field: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.field, self.headers = message, field, headers


class JobQuotaExceeded(Refused):
    status = 429
    code = "job_quota_exceeded"

    def __init__(self, owner: str, quota: int) -> None:
        super().__init__(
            f"owner {owner!r} already has {quota} jobs, its quota: delete jobs, or ask an operator to raise it "
            f"(chimes owner set {owner} --job-quota N)"
        )


class TaskNotAllowed(Refused):
    status = 403
    code = "task_not_allowed"

    def __init__(self, owner: str, task_type: str) -> None:
        super().__init__(
            f"owner {owner!r} may not run {task_type} tasks: an operator allows it with "
            f"`chimes owner set {owner} --allow-commands`", "task.type",
        )


class PriorityNotAllowed(Refused):
    """The ``high`` tier goes before every other run: a team that could give it to its own jobs could
    hold every worker slot ahead of the others, so only an admin grants it."""

    status = 403
    code = "priority_not_allowed"

    def __init__(self, owner: str) -> None:
        super().__init__(
            f"priority 'high' is granted by an admin: owner {owner!r} may use 'normal' or 'batch' (an admin token "
            "sets 'high' on a job with PATCH /jobs/{id})", "priority",
        )


class SecretNotKept(Refused):
    status = 422
    code = "invalid_request"

    def __init__(self, field: str) -> None:
        super().__init__(f"{field}: there is no stored secret to keep under this name; give its value", field)
