"""The gate in front of every page, and the login form (:mod:`ax_kombu.web.security` and
:mod:`ax_kombu.web.access` say what they guarantee).

The gate puts the caller's :class:`~ax_kombu.web.security.Identity` on
``request.state.identity``; each POST handler then names the role it needs
(:func:`~ax_kombu.web.console.checked_form`). The login form asks for a user and a
password when a users file is set, for the token when one is set, or both.
"""

from __future__ import annotations

from urllib.parse import quote

from starlette.concurrency import run_in_threadpool
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from ax_kombu.web.console import console_of, csrf_checked
from ax_kombu.web.security import SESSION_COOKIE

#: paths open without credentials: the login form and the stylesheet and script it uses,
#: and the probes (:mod:`ax_kombu.web.probes`)
OPEN = ("/login", "/static/", "/healthz", "/readyz")


class TokenGate(BaseHTTPMiddleware):
    """A request nobody the console knows sent is sent to the login form (GET, HEAD) or
    refused with 403 (anything else); any other is let in with its identity."""

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        access = console_of(request).access
        identity = access.identify(request.cookies.get(SESSION_COOKIE),
                                   request.headers.get("authorization"), request.headers)
        request.state.identity = identity
        if identity is not None or request.url.path.startswith(OPEN):
            return await call_next(request)
        if request.method in ("GET", "HEAD"):
            wanted = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            return RedirectResponse(f"/login?next={quote(wanted)}", 303)
        return PlainTextResponse("not logged in", 403)


def _local(path: str) -> str:
    """``path`` if it is a path of this site, else ``/`` (no open redirect)."""
    return path if path.startswith("/") and not path.startswith("//") else "/"


def login_form(request: Request) -> Response:
    console = console_of(request)
    return console.page(request, "login.html", next=_local(request.query_params.get("next", "/")))


async def login(request: Request) -> Response:
    """Check the user and password, or the token; set the session cookie (HttpOnly,
    SameSite=Strict): a new session id for a user, the token's HMAC for the token."""
    console = console_of(request)
    form = await csrf_checked(request)
    target = _local(str(form.get("next", "/")))
    user = str(form.get("user", "")).strip()
    if user:
        session = await run_in_threadpool(console.access.log_in, user,
                                          str(form.get("password", "")))
    else:
        given = str(form.get("token", ""))
        session = console.keys.session if console.keys.token_ok(given) else None
    if session is None:
        return console.page(request, "login.html", 401, next=target, failed=True)
    response = RedirectResponse(target, 303)
    response.set_cookie(SESSION_COOKIE, session, httponly=True, samesite="strict", path="/")
    return response


async def logout(request: Request) -> Response:
    await csrf_checked(request)
    console_of(request).access.log_out(request.cookies.get(SESSION_COOKIE))
    response = RedirectResponse("/login", 303)
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
    return response


ROUTES = [Route("/login", login_form, methods=["GET"]),
          Route("/login", login, methods=["POST"]),
          Route("/logout", logout, methods=["POST"])]
