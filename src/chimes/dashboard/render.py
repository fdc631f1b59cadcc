"""Rendering pages: one Jinja2 environment over the packaged templates, and the headers every page gets."""

from __future__ import annotations

from functools import cache
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import HTMLResponse

from chimes import __version__, wire
from chimes.api import standby
from chimes.api.clock import clock_of
from chimes.dashboard import session, views
from chimes.store.tokens import Principal

# Scripts only from this server (htmx, uPlot, ours); no inline script runs. Styles may be inline
# because uPlot sizes its canvas with style attributes.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


@cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("chimes.dashboard", "templates"),
        autoescape=True, trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined,
    )
    env.filters.update(
        duration=views.duration, utc=views.utc, iso=views.iso, short_id=views.short_id,
        schedule_text=views.schedule_text, task_summary=views.task_summary,
        partition_ranges=views.partition_ranges, thousands=lambda n: f"{n:,}", number=lambda x: f"{x:g}",
        definition=lambda job: wire.definition(job.columns),
    )
    env.globals.update(prefix=session.PREFIX, version=__version__, between=views.between)
    return env


def page(request: Request, template: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    """Render a template with what every page needs: the viewer, the CSRF token, the clock."""
    now = clock_of(request).now()
    token = session.session_token(request)
    context.setdefault("viewer", None)
    html = environment().get_template(template).render(
        request=request, now=now, ago=lambda moment: views.ago(moment, now),
        clock=lambda moment: views.clock(moment, now),
        csrf=session.csrf_token(token) if token else "", from_standby=standby.reading_from_standby(request),
        **context,
    )
    return HTMLResponse(html, status_code=status_code, headers=SECURITY_HEADERS)


def not_found(request: Request, who: Principal, what: str) -> HTMLResponse:
    """The 404 page for a job or run that does not exist, belongs to another team, or has an id
    that names nothing (read with chimes.ids.id_from / run_id_from, as the API reads them)."""
    return page(request, "not_found.html", status_code=404, viewer=who, what=what)
