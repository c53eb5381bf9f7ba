"""Cluster-wide limits with how many tasks of each type run now; set and clear
(``ax limits set|clear``: :meth:`Client.set_limit`)."""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ax_kombu.exceptions import ValidationError
from ax_kombu.store.console import running_by_type
from ax_kombu.web.console import (
    ADMINISTER,
    audited,
    back_to,
    checked_form,
    console_of,
    identity_of,
)


def limit_list(request: Request) -> Response:
    console = console_of(request)
    limits = console.client.limits()
    with console.engine.connect() as conn:
        running = running_by_type(conn, limits)
    me = identity_of(request)
    return console.page(request, "limits.html", limits=limits, running=running,
                        admin=me is not None and me.may(ADMINISTER))


async def set_limit(request: Request) -> Response:
    form = await checked_form(request, ADMINISTER)
    text = str(form.get("max_running", "")).strip()
    if not text.isdigit():
        raise ValidationError(f"max_running must be a whole number of at least 1, not {text!r}")
    task_type = str(form.get("task_type", ""))
    await run_in_threadpool(console_of(request).client.set_limit, task_type, int(text))
    await audited(request, "limit_set", f"type:{task_type}", {"max_running": int(text)})
    return back_to("/limits", "limit-set")


async def clear_limit(request: Request) -> Response:
    form = await checked_form(request, ADMINISTER)
    task_type = str(form.get("task_type", ""))
    await run_in_threadpool(console_of(request).client.set_limit, task_type, None)
    await audited(request, "limit_clear", f"type:{task_type}")
    return back_to("/limits", "limit-cleared")


ROUTES = [Route("/limits", limit_list, methods=["GET"]),
          Route("/limits/set", set_limit, methods=["POST"]),
          Route("/limits/clear", clear_limit, methods=["POST"])]
