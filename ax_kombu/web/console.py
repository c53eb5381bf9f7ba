"""What every page handler shares: the settings, one producer client (its engine and id
lease) for the whole process, the keys, and the templates with their filters."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.templating import Jinja2Templates

from ax_kombu.api import Client
from ax_kombu.config import Settings
from ax_kombu.observability.redaction import redact_url
from ax_kombu.store.audit import record
from ax_kombu.web.access import Access
from ax_kombu.web.security import CSRF_FIELD, LOCAL_IDENTITY, Identity, Keys

HERE = Path(__file__).parent
#: the most characters of a payload or result a task page shows
PAYLOAD_CAP = 4096
#: what a page says after an action redirected to it (``?note=``); other values show nothing
NOTES = {"cancelled": "Cancelled.", "retried": "Retried: READY, due now.",
         "run-now": "Moved to now: due at once.", "rescheduled": "Rescheduled.",
         "paused": "Paused.", "resumed": "Resumed.", "started": "One occurrence created, due now.",
         "quiet": "Quiet: the worker takes no new work (within one heartbeat).",
         "limit-set": "Limit set.", "limit-cleared": "Limit cleared."}
#: the role each kind of POST needs (:func:`checked_form`)
VIEW, OPERATE, ADMINISTER = "viewer", "operator", "admin"


def iso(ms: int | None) -> str:
    """Epoch ms as ``2026-12-05 01:02:03.456`` UTC ('-' for None)."""
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def shown(value: Any, cap: int = PAYLOAD_CAP) -> str:
    """``value`` as redacted JSON text of at most ``cap`` characters (and a note past it)."""
    text = redact_url(json.dumps(value, ensure_ascii=False, indent=2, default=str))
    if len(text) <= cap:
        return text
    return f"{text[:cap]}\n… ({len(text)} characters, the first {cap} shown)"


def _templates() -> Jinja2Templates:
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    templates.env.filters.update(iso=iso, redact=lambda v: redact_url(v) if v else v,
                                 shown=shown)
    return templates


@dataclass
class Console:
    """One console process's shared state (``request.app.state.console``)."""

    settings: Settings
    client: Client
    access: Access
    templates: Jinja2Templates

    @classmethod
    def open(cls, settings: Settings, access: Access) -> Console:
        return cls(settings, Client(settings), access, _templates())

    @property
    def keys(self) -> Keys:
        return self.access.keys

    @property
    def engine(self) -> Engine:
        """The store's engine (the client's: one pool for the whole console)."""
        return self.client.store.engine

    def page(self, request: Request, name: str, status_code: int = 200,
             **context: Any) -> Response:
        """Render template ``name`` with the CSRF token, who is logged in (``me``; None on
        the login form) and ``context``."""
        return self.templates.TemplateResponse(
            request, name, {"csrf": self.keys.csrf, "guarded": self.access.guarded,
                            "token_set": self.keys.token is not None,
                            "users_set": self.access.users is not None,
                            "csrf_field": CSRF_FIELD, "me": identity_of(request),
                            "note": NOTES.get(request.query_params.get("note", "")),
                            **context},
            status_code=status_code)

    def close(self) -> None:
        self.client.close()


def console_of(request: Request) -> Console:
    console: Console = request.app.state.console
    return console


def identity_of(request: Request) -> Identity | None:
    """Who sent ``request`` (set by the gate; None on the open paths: the login form)."""
    found: Identity | None = getattr(request.state, "identity", None)
    return found


def actor_of(request: Request) -> str:
    """The audit's actor of ``request``: its identity's name."""
    return (identity_of(request) or LOCAL_IDENTITY).name


async def checked_form(request: Request, role: str) -> FormData:
    """The POSTed form, once the caller's role is ``role`` or stronger and its CSRF
    field is this process's token.

    Raises:
        HTTPException: 403, the role is too weak (checked first: the form is not even
            read), or the CSRF field is missing or wrong; nothing was changed.
    """
    identity = identity_of(request)
    if identity is None or not identity.may(role):
        who = identity.name if identity else "nobody"
        raise HTTPException(403, f"{who} may not do this: it needs the {role} role")
    return await csrf_checked(request)


async def csrf_checked(request: Request) -> FormData:
    """The POSTed form, once its CSRF field is this process's token (the login form's
    check: there is no identity yet).

    Raises:
        HTTPException: 403, the field is missing or wrong (nothing was changed).
    """
    form = await request.form()
    if not console_of(request).keys.csrf_ok(form.get(CSRF_FIELD)):
        raise HTTPException(403, "missing or wrong CSRF token: reload the page and try again")
    return form


async def audited(request: Request, action: str, target: str,
                  detail: dict[str, Any] | None = None) -> None:
    """Record the action the request just took, as its identity, ``via="web"``
    (:func:`ax_kombu.store.audit.record`)."""
    await run_in_threadpool(record, console_of(request).engine, actor=actor_of(request),
                            via="web", action=action, target=target, detail=detail)


def back_to(path: str, note: str) -> RedirectResponse:
    """After a POST: see ``path`` again (303), with the note (:data:`NOTES`) of what was
    done."""
    assert note in NOTES
    return RedirectResponse(f"{path}?note={note}", 303)
