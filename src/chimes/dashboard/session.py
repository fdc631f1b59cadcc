"""Dashboard sign-in: the same API tokens, kept in a cookie, and CSRF protection for every form.

The cookie holds the token itself, so the dashboard stays stateless like the API (any API process
can serve any page) and a revoked token stops working at once. It is HttpOnly (scripts cannot read
it), SameSite=Strict (other sites cannot make the browser send it) and Secure over https. Forms
also carry a CSRF token derived from the session token with HMAC: only a page we rendered knows it.
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import parse_qs, quote

from fastapi import Request

from chimes.api import standby
from chimes.api.limits import judge_credential
from chimes.store.tokens import Principal, authenticate

COOKIE = "chimes_session"
COOKIE_MAX_AGE = 12 * 3600
PREFIX = "/ui"


class LoginRequired(Exception):
    """Raised by :func:`viewer` when there is no valid session; answered with the login page."""

    def __init__(self, next_path: str) -> None:
        super().__init__(next_path)
        self.next_path = next_path


class FormRefused(Exception):
    """A form refused before it changed anything: no or a wrong CSRF token, sent from another site,
    or sent with a read-only token."""


def session_token(request: Request) -> str | None:
    return request.cookies.get(COOKIE) or None


def csrf_token(session: str) -> str:
    return hmac.new(session.encode(), b"chimes-dashboard-csrf", hashlib.sha256).hexdigest()


async def viewer(request: Request) -> Principal:
    """The signed-in principal; :class:`LoginRequired` when the cookie is missing, invalid or revoked."""
    token = session_token(request)
    pool = standby.pool(request)
    # A guess carried in the cookie counts as one in a header would.
    principal = await judge_credential(request.scope, token, lambda guess: authenticate(pool, guess)) if token else None
    if principal is None:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise LoginRequired(target if request.method == "GET" else f"{PREFIX}/jobs")
    return principal


async def form_data(request: Request) -> dict[str, str]:
    """An url-encoded form body, one value per field (the dashboard's forms are that simple)."""
    body = (await request.body()).decode("utf-8", errors="replace")
    return {name: values[0] for name, values in parse_qs(body, keep_blank_values=True).items()}


async def checked_form(request: Request, principal: Principal | None = None) -> dict[str, str]:
    """The form of a state-changing request, after the same-origin, CSRF and scope checks."""
    if principal is not None and not principal.can_write:
        raise FormRefused("this token is read-only (scope 'read'): sign in with a write or admin token to change jobs")
    origin = request.headers.get("origin")
    if origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}":
        raise FormRefused("the form was sent from another site")
    form = await form_data(request)
    session = session_token(request)
    if not session or not hmac.compare_digest(form.get("csrf", ""), csrf_token(session)):
        raise FormRefused("the form is stale or was not sent by this dashboard; reload the page and try again")
    return form


def safe_next(value: str | None) -> str:
    """Where to go after signing in: only a path of this dashboard, never another site."""
    if value and value.startswith(PREFIX + "/") and not value.startswith("//") and "\\" not in value:
        return value
    return f"{PREFIX}/jobs"


def login_url(next_path: str) -> str:
    return f"{PREFIX}/login?next={quote(safe_next(next_path), safe='/')}"


def is_secure(request: Request) -> bool:
    return request.url.scheme == "https"


async def sign_in(request: Request, token: str) -> Principal | None:
    """The principal of the token typed into the sign-in form; a wrong one counts as a failed attempt
    (judge_credential), whatever headers the request also carries."""
    token = token.strip()
    pool = request.app.state.pool
    return await judge_credential(request.scope, token, lambda guess: authenticate(pool, guess))


def cookie_settings(request: Request) -> dict[str, object]:
    return {"key": COOKIE, "httponly": True, "samesite": "strict", "secure": is_secure(request), "path": "/"}
