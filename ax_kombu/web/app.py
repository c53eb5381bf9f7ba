"""The console as a Starlette application, and :func:`serve`, which runs it under uvicorn.

Pages are rendered on the server by Jinja2 with autoescaping on, so a task type, payload
or error holding ``<script>`` shows as text; the one script (``static/console.js``)
refreshes the overview and asks before an action. Every response forbids framing and
any script, style or image not served by the console itself (no CDN: every asset ships
in this package). An :class:`~ax_kombu.exceptions.AxError` becomes an error page with
its one-line message (URLs redacted) and a status that says what went wrong.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

from ax_kombu.config import Settings
from ax_kombu.exceptions import (
    AxError,
    IllegalTransition,
    JobNotFound,
    StoreError,
    TaskNotFound,
)
from ax_kombu.observability.redaction import redact_url
from ax_kombu.web import alerts, audit, auth, jobs, limits, overview, pauses, probes, tasks
from ax_kombu.web.access import Access
from ax_kombu.web.console import HERE, Console, console_of
from ax_kombu.web.security import LOOPBACK_HOSTS, Keys

HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; frame-ancestors 'none'; "
                               "form-action 'self'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class SecurityHeaders(BaseHTTPMiddleware):
    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        response = await call_next(request)
        response.headers.update(HEADERS)
        return response


def _status(exc: AxError) -> int:
    if isinstance(exc, (TaskNotFound, JobNotFound)):
        return 404
    if isinstance(exc, IllegalTransition):
        return 409
    return 503 if isinstance(exc, StoreError) else 400


async def _ax_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, AxError)
    return console_of(request).page(request, "error.html", _status(exc),
                                    message=redact_url(str(exc)))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return console_of(request).page(request, "error.html", exc.status_code, message=exc.detail)


def create_app(settings: Settings, token: str | None = None,
               access: Access | None = None) -> Starlette:
    """The console on ``settings``' store. With ``token`` (or ``access``: the token, the
    users file, the trusted header), every page needs credentials; without, only
    requests to a loopback host name are answered."""
    access = access if access is not None else Access(Keys(token))
    console = Console.open(settings, access)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        console.close()

    hosts = ["*"] if access.guarded else list(LOOPBACK_HOSTS)
    app = Starlette(
        routes=[*auth.ROUTES, *overview.ROUTES, *tasks.ROUTES, *jobs.ROUTES, *limits.ROUTES,
                *pauses.ROUTES, *alerts.ROUTES, *audit.ROUTES, *probes.ROUTES,
                Mount("/static", StaticFiles(directory=HERE / "static"), name="static")],
        middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=hosts),
                    Middleware(SecurityHeaders), Middleware(auth.TokenGate)],
        exception_handlers={AxError: _ax_error, HTTPException: _http_error},
        lifespan=lifespan)
    app.state.console = console
    return app


def serve(settings: Settings, bind: str, port: int, access: Access) -> None:
    """Run the console until SIGINT or SIGTERM (uvicorn's warm shutdown)."""
    import uvicorn

    uvicorn.run(create_app(settings, access=access), host=bind, port=port, access_log=False,
                log_level="info")
