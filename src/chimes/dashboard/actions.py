"""What the dashboard's buttons do: sign in and out, run now, pause, resume, re-run, cancel.

Every action is a form POST checked for origin and CSRF token (session.checked_form), runs as the
signed-in principal with the same ownership rules as the API, and answers with a redirect to the
page that shows its result (post/redirect/get, so a reload never repeats it).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from chimes.api import homes
from chimes.api.actors import note_of
from chimes.api.clock import clock_of
from chimes.dashboard import session
from chimes.dashboard.pages import Viewer
from chimes.dashboard.render import not_found, page
from chimes.ids import id_from, run_id_from
from chimes.jobs import JobPatch
from chimes.store.tokens import Principal

router = APIRouter(include_in_schema=False)
P = session.PREFIX


@router.get("/login", response_class=HTMLResponse)
async def login_form(request: Request, next: str | None = None) -> HTMLResponse:
    return page(request, "login.html", next=session.safe_next(next), error=None)


@router.post("/login", response_model=None)
async def login(request: Request) -> Response:
    origin = request.headers.get("origin")
    if origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}":
        raise session.FormRefused("the sign-in form was sent from another site")
    form = await session.form_data(request)
    target = session.safe_next(form.get("next"))
    principal = await session.sign_in(request, form.get("token", ""))
    if principal is None:
        return page(request, "login.html", status_code=401, next=target,
                    error="That token is not valid, or it was revoked. Paste a token made by chimes up "
                          "or chimes token create.")
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(value=form["token"].strip(), max_age=session.COOKIE_MAX_AGE,
                        **session.cookie_settings(request))  # type: ignore[arg-type]
    return response


@router.post("/logout")
async def logout(request: Request) -> RedirectResponse:
    await session.checked_form(request)
    response = RedirectResponse(f"{P}/login", status_code=303)
    response.delete_cookie(**session.cookie_settings(request))  # type: ignore[arg-type]
    return response


@router.post("/jobs/{job_id}/run", response_model=None)
async def run_now(job_id: str, request: Request, who: Viewer) -> Response:
    await session.checked_form(request, who)
    parsed = id_from(job_id)
    if parsed is None:
        return not_found(request, who, "job")
    runs = await homes.runs_of(request, parsed)
    run_id = await runs.start_now(parsed, who.owner_filter, "manual", clock_of(request).now(), note_of(request, who))
    if not run_id:
        return not_found(request, who, "job")
    return RedirectResponse(f"{P}/jobs/{job_id}?notice=started&started={run_id}", status_code=303)


@router.post("/jobs/{job_id}/pause", response_model=None)
async def pause(job_id: str, request: Request, who: Viewer) -> Response:
    return await _set_paused(job_id, request, who, paused=True)


@router.post("/jobs/{job_id}/resume", response_model=None)
async def resume(job_id: str, request: Request, who: Viewer) -> Response:
    return await _set_paused(job_id, request, who, paused=False)


async def _set_paused(job_id: str, request: Request, who: Principal, *, paused: bool) -> Response:
    form = await session.checked_form(request, who)
    parsed = id_from(job_id)
    if parsed is None:
        return not_found(request, who, "job")
    jobs = await homes.jobs_of(request, parsed)
    pause_note = (form.get("note") or "").strip()[:1000] or None if paused else None
    job = await jobs.update(parsed, who.owner_filter, JobPatch(paused=paused, pause_note=pause_note),
                            clock_of(request).now(), note=note_of(request, who), actor=who.actor)
    if not job:
        return not_found(request, who, "job")
    return RedirectResponse(f"{P}/jobs/{job_id}?notice={'paused' if paused else 'resumed'}", status_code=303)


@router.post("/runs/{run_id}/rerun", response_model=None)
async def rerun(run_id: str, request: Request, who: Viewer) -> Response:
    await session.checked_form(request, who)
    parsed = run_id_from(run_id)
    if parsed is None:
        return not_found(request, who, "run")
    store = await homes.runs_of_run(request, parsed)
    found = await store.get(parsed, who.owner_filter)
    if not found:
        return not_found(request, who, "run")
    new_run = await store.start_now(found.job_id, who.owner_filter, "rerun", clock_of(request).now(),
                                    note_of(request, who))
    if new_run is None:
        return page(request, "not_found.html", status_code=409, viewer=who, what="job",
                    detail="The job of this run was deleted, so it cannot run again.")
    return RedirectResponse(f"{P}/runs/{new_run}?notice=started", status_code=303)


@router.post("/runs/{run_id}/cancel", response_model=None)
async def cancel(run_id: str, request: Request, who: Viewer) -> Response:
    await session.checked_form(request, who)
    parsed = run_id_from(run_id)
    if parsed is None:
        return not_found(request, who, "run")
    store = await homes.runs_of_run(request, parsed)
    if await store.get(parsed, who.owner_filter) is None:
        return not_found(request, who, "run")
    done = await store.cancel(parsed, who.owner_filter, f"cancelled by {who.owner} (dashboard)",
                              note_of(request, who))
    return RedirectResponse(f"{P}/runs/{run_id}?notice={'cancelled' if done else 'already-finished'}",
                            status_code=303)
