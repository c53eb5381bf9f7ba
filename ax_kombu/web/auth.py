"""The token gate in front of every page, and the login form (:mod:`ax_kombu.web.security`
says what they guarantee)."""

from __future__ import annotations

from urllib.parse import quote

from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from ax_kombu.web.console import checked_form, console_of
from ax_kombu.web.security import SESSION_COOKIE

#: paths open without the token: the login form and the stylesheet and script it uses
OPEN = ("/login", "/static/")


class TokenGate(BaseHTTPMiddleware):
    """With a token set: a request without the session cookie or the bearer token is
    sent to the login form (GET, HEAD) or refused with 403 (anything else)."""

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        keys = console_of(request).keys
        if request.url.path.startswith(OPEN) or keys.allowed(
                request.cookies.get(SESSION_COOKIE), request.headers.get("authorization")):
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
    """Check the token; set the session cookie (HttpOnly, SameSite=Strict)."""
    console = console_of(request)
    form = await checked_form(request)
    target = _local(str(form.get("next", "/")))
    if not console.keys.token_ok(str(form.get("token", ""))):
        return console.page(request, "login.html", 401, next=target, failed=True)
    response = RedirectResponse(target, 303)
    response.set_cookie(SESSION_COOKIE, console.keys.session, httponly=True,
                        samesite="strict", path="/")
    return response


async def logout(request: Request) -> Response:
    await checked_form(request)
    response = RedirectResponse("/login", 303)
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
    return response


ROUTES = [Route("/login", login_form, methods=["GET"]),
          Route("/login", login, methods=["POST"]),
          Route("/logout", logout, methods=["POST"])]
