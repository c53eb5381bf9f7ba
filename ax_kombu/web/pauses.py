"""Paused task types and queues, with how many tasks each holds back; pause and resume
(operator role; ``ax pause-type``, ``ax queues pause``: :mod:`ax_kombu.store.pauses`).
Each change is recorded in the audit as the caller."""

from __future__ import annotations

from functools import partial

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ax_kombu.config import PRIORITIES
from ax_kombu.exceptions import ValidationError
from ax_kombu.store import pauses
from ax_kombu.web.console import OPERATE, actor_of, back_to, checked_form, console_of, identity_of


def pause_list(request: Request) -> Response:
    console = console_of(request)
    settings = console.client.settings
    queues = {settings.queue_for(p): p for p in PRIORITIES}
    with console.engine.connect() as conn:
        found = pauses.list_pauses(conn)
        waiting = pauses.waiting_by_pause(conn, found, queues.get)
    me = identity_of(request)
    return console.page(request, "pauses.html", pauses=found, waiting=waiting, queues=queues,
                        operator=me is not None and me.may(OPERATE))


async def _change(request: Request, on: bool) -> Response:
    form = await checked_form(request, OPERATE)
    kind, name = str(form.get("kind", "")), str(form.get("name", "")).strip()
    client = console_of(request).client
    calls = {("type", True): client.pause_type, ("type", False): client.resume_type,
             ("queue", True): client.pause_queue, ("queue", False): client.resume_queue}
    if (kind, on) not in calls:
        raise ValidationError(f"kind must be type or queue, not {kind!r}")
    await run_in_threadpool(partial(calls[kind, on], name, actor=actor_of(request), via="web"))
    return back_to("/pauses", "paused" if on else "resumed")


async def pause(request: Request) -> Response:
    return await _change(request, True)


async def resume(request: Request) -> Response:
    return await _change(request, False)


ROUTES = [Route("/pauses", pause_list, methods=["GET"]),
          Route("/pauses/pause", pause, methods=["POST"]),
          Route("/pauses/resume", resume, methods=["POST"])]
