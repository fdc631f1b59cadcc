"""The web dashboard: server-rendered pages under ``/ui``, served by the API process itself.

Everything it needs ships in this package (templates, htmx, uPlot, styles): it works with no
internet access. It signs in with the same tokens as the API and sees exactly what they see.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from chimes.dashboard import actions, pages, session
from chimes.dashboard.render import page


def install(app: FastAPI) -> None:
    app.include_router(pages.router, prefix=session.PREFIX)
    app.include_router(actions.router, prefix=session.PREFIX)
    app.mount(f"{session.PREFIX}/static", StaticFiles(packages=[("chimes.dashboard", "static")]), name="static")

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse(f"{session.PREFIX}/jobs", status_code=303)

    @app.get(session.PREFIX, include_in_schema=False)
    async def ui_root() -> RedirectResponse:
        return RedirectResponse(f"{session.PREFIX}/jobs", status_code=303)

    @app.exception_handler(session.LoginRequired)
    async def _login_required(request: Request, exc: session.LoginRequired) -> Response:
        url = session.login_url(exc.next_path)
        if request.headers.get("hx-request"):  # a background refresh: make htmx load the login page
            return Response(status_code=401, headers={"HX-Redirect": url})
        return RedirectResponse(url, status_code=303)

    @app.exception_handler(session.FormRefused)
    async def _csrf_rejected(request: Request, exc: session.FormRefused) -> HTMLResponse:
        return page(request, "not_found.html", status_code=403, what="form", detail=str(exc))
