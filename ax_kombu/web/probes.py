"""The console's probes, open without a login (:data:`ax_kombu.web.auth.OPEN`).

``GET /healthz``: the console is serving (it answers, so it is). ``GET /readyz``: its
database answers a ``SELECT 1`` within :data:`DEADLINE_S`. Each answers 200 or 503 with
one line of JSON, as the daemons' probes do (:mod:`ax_kombu.observability.probes`).
"""

from __future__ import annotations

import asyncio

from sqlalchemy import Engine, text
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ax_kombu.observability.probes import Answer
from ax_kombu.observability.redaction import redact_url
from ax_kombu.web.console import console_of

#: how long /readyz waits for the database before it says it is unreachable
DEADLINE_S = 2.0


async def healthz(request: Request) -> Response:
    return _respond(Answer(True, "serving"))


async def readyz(request: Request) -> Response:
    return _respond(await database_answer(console_of(request).engine))


async def database_answer(engine: Engine, deadline_s: float = DEADLINE_S) -> Answer:
    """Does ``engine``'s database answer within ``deadline_s``?"""
    try:
        await asyncio.wait_for(run_in_threadpool(_ping, engine), deadline_s)
    except TimeoutError:
        return Answer(False, f"database unreachable: no answer within {deadline_s:g} s",
                      "database")
    except SQLAlchemyError as exc:
        why = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        return Answer(False, "database unreachable: " + redact_url(why[0] if why else "error")[:200],
                      "database")
    return Answer(True, "database reachable")


def _ping(engine: Engine) -> None:
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))


def _respond(answer: Answer) -> Response:
    return Response(answer.body(), answer.status, media_type="application/json",
                    headers={"Cache-Control": "no-store"})


ROUTES = [Route("/healthz", healthz, methods=["GET", "HEAD"]),
          Route("/readyz", readyz, methods=["GET", "HEAD"])]
