"""The record of operator actions (``/audit``, every role may read it): newest first, over
the window ``?since=`` asks for (``1d`` unless told), the same rows ``ax audit`` prints
(:mod:`ax_kombu.store.audit`)."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ax_kombu.config import parse_duration_ms
from ax_kombu.exceptions import AxError
from ax_kombu.store.audit import Entry, now_ms, read_since
from ax_kombu.web.console import console_of

#: the most records the page shows (the newest)
SHOWN = 500
SINCE_DEFAULT = "1d"


def _read(request: Request, age_ms: int) -> list[Entry]:
    engine = console_of(request).engine
    return read_since(engine, now_ms(engine) - age_ms, limit=SHOWN)


async def audit_page(request: Request) -> Response:
    console = console_of(request)
    since = request.query_params.get("since", "").strip() or SINCE_DEFAULT
    try:
        age_ms = parse_duration_ms(since)
    except AxError as exc:
        return console.page(request, "audit.html", 400, since=since, entries=[],
                            error=f"since: {exc}", shown=SHOWN)
    entries = await run_in_threadpool(_read, request, age_ms)
    return console.page(request, "audit.html", since=since, entries=entries, error=None,
                        shown=SHOWN)


ROUTES = [Route("/audit", audit_page, methods=["GET"])]
