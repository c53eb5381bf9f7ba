"""Per-type alerts in the console (``ax alerts``: :meth:`Client.set_alert`,
:meth:`Client.remove_alert`): every role reads them with their incident state; an admin
sets, changes and removes them.

The page shows a webhook as ``scheme://host/…`` only: its path or query may carry the
receiver's token. The signing secret is never on the page, except once, in the answer to
the POST that set the alert (not stored in the browser: ``Cache-Control: no-store``).
Bad input gets the page again with the API's :class:`~ax_kombu.exceptions.ValidationError`
message (status 400), and nothing is written.
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from ax_kombu.alerts.rules import EVENTS
from ax_kombu.exceptions import ValidationError
from ax_kombu.observability.redaction import redact_url
from ax_kombu.observability.redaction import url_origin as webhook_host
from ax_kombu.store import alerts as alert_store
from ax_kombu.web.console import ADMINISTER, audited, checked_form, console_of, identity_of

#: what the page says after a removal (``?note=``)
NOTES = {"alert-removed": "Alert removed.", "alert-none": "There was no such alert."}


def _view(row: dict[str, Any]) -> dict[str, Any]:
    """An ``ax_alert`` row as the page shows it (no secret, no full webhook)."""
    return {"task_type": row["task_type"],
            "on": [e for e in EVENTS if row[f"on_{e}"]],
            "late_after_s": None if row["late_after_ms"] is None
            else f"{row['late_after_ms'] / 1000:g}s",
            "webhook": webhook_host(row["webhook"]),
            "opened_at": row["opened_at"], "last_event_at": row["last_event_at"],
            "events": row["events"], "updated_at": row["updated_at"]}


def _rows(request: Request) -> list[dict[str, Any]]:
    with console_of(request).engine.connect() as conn:
        return alert_store.list_all(conn)


def _form_of(row: dict[str, Any] | None) -> dict[str, Any]:
    """The set form's fields, filled from ``row`` (None: a new alert, on failures)."""
    if row is None:
        return {"task_type": "", "on": ["failed"], "late_after": "", "webhook": ""}
    late = row["late_after_ms"]
    return {"task_type": row["task_type"], "on": [e for e in EVENTS if row[f"on_{e}"]],
            "late_after": "" if late is None else f"{late / 1000:g}s", "webhook": ""}


def _page(request: Request, rows: list[dict[str, Any]], status_code: int = 200,
          **context: Any) -> Response:
    me = identity_of(request)
    context.setdefault("form", _form_of(None))
    note = NOTES.get(request.query_params.get("note", ""))
    extra = {"note": note} if note else {}
    return console_of(request).page(request, "alerts.html", status_code,
                                    alerts=[_view(r) for r in rows], events=EVENTS,
                                    admin=me is not None and me.may(ADMINISTER),
                                    **extra, **context)


def alert_list(request: Request) -> Response:
    rows = _rows(request)
    editing = request.query_params.get("edit")
    found = next((r for r in rows if r["task_type"] == editing), None)
    return _page(request, rows, form=_form_of(found), editing=found is not None)


def _submitted(form: FormData) -> dict[str, Any]:
    """The set form's fields as typed (the secret left out: it is never shown back)."""
    return {"task_type": str(form.get("task_type", "")).strip(),
            "on": [str(e) for e in form.getlist("on")],
            "late_after": str(form.get("late_after", "")).strip(),
            "webhook": str(form.get("webhook", "")).strip()}


def _detail(saved: dict[str, Any] | None, webhook: str) -> dict[str, Any]:
    """The audit detail of a set: what the alert now watches, and where (host only; only
    the webhook typed if the alert was removed since, by another request)."""
    if saved is None:
        return {"webhook": webhook_host(webhook)}
    return {"on": [e for e in EVENTS if saved[f"on_{e}"]],
            "late_after_ms": saved["late_after_ms"], "webhook": webhook_host(saved["webhook"])}


async def set_alert(request: Request) -> Response:
    form = await checked_form(request, ADMINISTER)
    fields = _submitted(form)
    secret = str(form.get("secret", "")).strip() or None
    client = console_of(request).client
    try:
        key = await run_in_threadpool(
            lambda: client.set_alert(fields["task_type"], on=fields["on"],
                                     late_after=fields["late_after"] or None,
                                     webhook=fields["webhook"], secret=secret))
    except ValidationError as exc:
        rows = await run_in_threadpool(_rows, request)
        return _page(request, rows, 400, form=fields, error=redact_url(str(exc)))
    rows = await run_in_threadpool(_rows, request)
    saved = next((r for r in rows if r["task_type"] == fields["task_type"]), None)
    await audited(request, "alert_set", f"type:{fields['task_type']}",
                  _detail(saved, fields["webhook"]))
    answer = _page(request, rows, secret=key, saved=None if saved is None else _view(saved))
    answer.headers["Cache-Control"] = "no-store"
    return answer


async def remove_alert(request: Request) -> Response:
    form = await checked_form(request, ADMINISTER)
    task_type = str(form.get("task_type", ""))
    removed = await run_in_threadpool(console_of(request).client.remove_alert, task_type)
    if removed:
        await audited(request, "alert_remove", f"type:{task_type}")
    return RedirectResponse(f"/alerts?note={'alert-removed' if removed else 'alert-none'}",
                            303)


ROUTES = [Route("/alerts", alert_list, methods=["GET"]),
          Route("/alerts/set", set_alert, methods=["POST"]),
          Route("/alerts/remove", remove_alert, methods=["POST"])]
