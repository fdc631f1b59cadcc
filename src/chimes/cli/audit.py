"""``chimes audit``: who changed what, from ``GET /audit`` (docs/security.md, "Audit trail")."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from chimes.cli.client import _echo_json, _job_id, api_options, json_option
from chimes.cli.client_render import when
from chimes.client import Client

PAGE_SIZE = 500


@click.command("audit")
@api_options
@click.option("--actor", default=None, help="Only changes by this owner or token name.")
@click.option("--job", "job_id", default=None, help="Only changes to this job (and its runs).")
@click.option("--action", default=None, help="Only this kind of change, e.g. job.update, run.cancel, token.create.")
@click.option("--since", default=None, help="Only changes at or after this time (RFC 3339).")
@click.option("--until", default=None, help="Only changes before this time (RFC 3339).")
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True, help="Entries to show.")
@json_option
def audit(api: Client, actor: str | None, job_id: str | None, action: str | None, since: str | None,
          until: str | None, limit: int, as_json: bool) -> None:
    """Show the audit trail, newest first: every change, who made it (token and owner), when, and under
    which request. Admin tokens see every entry; an owner's token the entries of its own jobs."""
    params: dict[str, Any] = {"actor": actor, "jobId": _job_id(api, job_id) if job_id else None,
                              "action": action, "since": since, "until": until}
    entries: list[dict[str, Any]] = []
    cursor = None
    while len(entries) < limit:
        page = api.call("GET", "/audit", params={**params, "limit": min(PAGE_SIZE, limit - len(entries)),
                                                 "cursor": cursor})
        entries += page["entries"]
        cursor = page.get("nextCursor")
        if not cursor:
            break
    if as_json:
        _echo_json({"entries": entries, "nextCursor": cursor})
        return
    table = Table("at", "actor", "action", "subject", "changes", "request id")
    for entry in entries:
        who = entry["actor"]
        actor_text = f"{who.get('tokenName') or who.get('tokenId') or ''} ({who['owner']})"
        table.add_row(when(entry["at"]), actor_text, entry["action"], entry["subject"],
                      changed_fields(entry["changes"]), entry.get("requestId") or "")
    Console(width=200).print(table)


def changed_fields(changes: dict[str, Any]) -> str:
    """``field: before -> after`` per changed field, values cut short."""
    def short(value: Any) -> str:
        text = json.dumps(value, default=str)
        return text if len(text) <= 40 else text[:39] + "…"
    return "; ".join(f"{field}: {short(c['before'])} -> {short(c['after'])}" for field, c in changes.items())
