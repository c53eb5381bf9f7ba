"""Tasks: search (keyset pages, :func:`ax_kombu.store.console.search_tasks`), one task with
its attempts, moves and each attempt's own log lines (:func:`ax_kombu.store.run_logs.logs_of`), and the actions the CLI has — ``ax cancel`` (:meth:`Client.cancel`),
``ax retry`` (:func:`ax_kombu.store.admin.retry_ids`) and, for a task that has not started,
``ax reschedule`` (:meth:`Client.run_now`, :meth:`Client.reschedule`). A move the store
refuses (the task was claimed meanwhile, or finished) changes nothing, and the task's page
says why."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ax_kombu.config import parse_duration_ms
from ax_kombu.core.states import CLAIMABLE, FINAL, Status
from ax_kombu.exceptions import AxError, IllegalTransition, ValidationError
from ax_kombu.store.admin import RETRYABLE, parse_status, retry_ids
from ax_kombu.store.console import TaskSearch, search_tasks
from ax_kombu.store.run_logs import logs_of
from ax_kombu.views import TaskView
from ax_kombu.web.console import (
    OPERATE,
    audited,
    back_to,
    checked_form,
    console_of,
    identity_of,
)

PAGE = 50
#: the search form's fields, in the order shown
FIELDS = ("id", "biz_key", "type", "status", "from", "to")


def _int(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValidationError(f"{name} must be a whole number, not {text!r}") from None


def _time(name: str, text: str) -> datetime:
    """``2026-12-05T01:02`` (UTC, as a datetime-local field sends it; or with an offset)."""
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise ValidationError(f"{name} must be a date and time like 2026-12-05T01:02, "
                              f"not {text!r}") from None
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def _ms(name: str, text: str) -> int:
    """:func:`_time` as epoch ms."""
    return int(_time(name, text).timestamp() * 1000)


def parse_search(query: Mapping[str, str]) -> TaskSearch:
    """The search a query string asks for; empty fields are not filters.

    Raises:
        ValidationError: a field is malformed.
    """
    given = {k: query[k].strip() for k in (*FIELDS, "before") if query.get(k, "").strip()}
    return TaskSearch(
        task_id=_int("id", given["id"]) if "id" in given else None,
        biz_key=given.get("biz_key"), task_type=given.get("type"),
        status=parse_status(given["status"]) if "status" in given else None,
        created_from_ms=_ms("from", given["from"]) if "from" in given else None,
        created_to_ms=_ms("to", given["to"]) if "to" in given else None,
        before_id=_int("before", given["before"]) if "before" in given else None,
        limit=PAGE)


def task_list(request: Request) -> Response:
    console = console_of(request)
    query = {k: request.query_params.get(k, "") for k in FIELDS}
    try:
        wanted = parse_search(request.query_params)
    except ValidationError as exc:
        return console.page(request, "tasks.html", 400, query=query, rows=[], error=str(exc),
                            statuses=list(Status), next_query=None)
    with console.engine.connect() as conn:
        rows = search_tasks(conn, wanted)
    first = {k: v for k, v in query.items() if v}
    more = {**first, "before": str(rows[-1].task_id)} if len(rows) == PAGE else None
    return console.page(request, "tasks.html", query=query, rows=rows, error=None,
                        statuses=list(Status), next_query=more, first_query=first,
                        paged="before" in request.query_params)


def _task_page(request: Request, view: TaskView, status_code: int = 200,
               error: str | None = None) -> Response:
    console = console_of(request)
    me = identity_of(request)
    live = not view.archived and me is not None and me.may(OPERATE)
    return console.page(
        request, "task.html", status_code, task=view, error=error,
        logs=logs_of(console.engine, view.task_id),
        can_cancel=live and view.status not in FINAL,
        can_retry=live and view.status in RETRYABLE,
        can_move=live and view.status in CLAIMABLE)


def task_page(request: Request) -> Response:
    view = console_of(request).client.get(_int("task id", request.path_params["task_id"]))
    return _task_page(request, view)


async def cancel(request: Request) -> Response:
    await checked_form(request, OPERATE)
    task_id = _int("task id", request.path_params["task_id"])
    await run_in_threadpool(console_of(request).client.cancel, task_id)
    await audited(request, "cancel", f"task:{task_id}")
    return back_to(f"/tasks/{task_id}", "cancelled")


async def retry(request: Request) -> Response:
    await checked_form(request, OPERATE)
    console = console_of(request)
    task_id = _int("task id", request.path_params["task_id"])
    outcome = await run_in_threadpool(retry_ids, console.engine, [task_id])
    if not outcome.retried:
        raise IllegalTransition(f"task {task_id} is {outcome.refused.get(task_id)}; only "
                                "FAILED or CANCELLED tasks can be retried")
    await audited(request, "retry", f"task:{task_id}")
    return back_to(f"/tasks/{task_id}", "retried")


def _postpone_to(form: Mapping[str, object]) -> tuple[datetime | None, timedelta | None]:
    """The Postpone form's ``at`` (UTC unless it has an offset) or ``delay`` (``10m``), as
    ``reschedule``'s ``run_at`` and ``delay``.

    Raises:
        ValidationError: neither or both given, or one is malformed.
    """
    delay, at = (str(form.get(k, "")).strip() for k in ("delay", "at"))
    if bool(delay) == bool(at):
        raise ValidationError("postpone needs a delay (e.g. 10m) or a time, not both")
    if at:
        return _time("time", at), None
    try:
        return None, timedelta(milliseconds=parse_duration_ms(delay))
    except AxError as exc:
        raise ValidationError(f"delay: {exc}") from None


async def _move(request: Request, how: Callable[[int], TaskView], note: str,
                action: str) -> Response:
    """Move the task with ``how``; a refusal shows on the task's page (409, or 400 for bad
    input) and changes nothing."""
    task_id = _int("task id", request.path_params["task_id"])
    try:
        moved = await run_in_threadpool(how, task_id)
    except (IllegalTransition, ValidationError) as exc:
        view = await run_in_threadpool(console_of(request).client.get, task_id)
        status = 409 if isinstance(exc, IllegalTransition) else 400
        return _task_page(request, view, status, str(exc))
    await audited(request, action, f"task:{task_id}", {"trigger_time": moved.trigger_time})
    return back_to(f"/tasks/{task_id}", note)


async def run_now(request: Request) -> Response:
    await checked_form(request, OPERATE)
    return await _move(request, console_of(request).client.run_now, "run-now", "run_now")


async def postpone(request: Request) -> Response:
    form = await checked_form(request, OPERATE)
    client = console_of(request).client

    def move(task_id: int) -> TaskView:
        run_at, delay = _postpone_to(form)
        return client.reschedule(task_id, run_at=run_at, delay=delay)

    return await _move(request, move, "rescheduled", "reschedule")


ROUTES = [Route("/tasks", task_list, methods=["GET"]),
          Route("/tasks/{task_id}", task_page, methods=["GET"]),
          Route("/tasks/{task_id}/cancel", cancel, methods=["POST"]),
          Route("/tasks/{task_id}/retry", retry, methods=["POST"]),
          Route("/tasks/{task_id}/run-now", run_now, methods=["POST"]),
          Route("/tasks/{task_id}/postpone", postpone, methods=["POST"])]
