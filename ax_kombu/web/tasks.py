"""Tasks: search (keyset pages, :func:`ax_kombu.store.console.search_tasks`), one task with
its attempts, and the two actions the CLI has — ``ax cancel`` (:meth:`Client.cancel`) and
``ax retry`` (:func:`ax_kombu.store.admin.retry_ids`)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ax_kombu.core.states import FINAL, Status
from ax_kombu.exceptions import IllegalTransition, ValidationError
from ax_kombu.store.admin import RETRYABLE, parse_status, retry_ids
from ax_kombu.store.console import TaskSearch, search_tasks
from ax_kombu.web.console import back_to, checked_form, console_of

PAGE = 50
#: the search form's fields, in the order shown
FIELDS = ("id", "biz_key", "type", "status", "from", "to")


def _int(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValidationError(f"{name} must be a whole number, not {text!r}") from None


def _ms(name: str, text: str) -> int:
    """``2026-12-05T01:02`` (UTC, as a datetime-local field sends it) as epoch ms."""
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise ValidationError(f"{name} must be a date and time like 2026-12-05T01:02, "
                              f"not {text!r}") from None
    return int((at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp() * 1000)


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


def task_page(request: Request) -> Response:
    console = console_of(request)
    view = console.client.get(_int("task id", request.path_params["task_id"]))
    return console.page(request, "task.html", task=view,
                        can_cancel=view.status not in FINAL and not view.archived,
                        can_retry=view.status in RETRYABLE and not view.archived)


async def cancel(request: Request) -> Response:
    await checked_form(request)
    task_id = _int("task id", request.path_params["task_id"])
    await run_in_threadpool(console_of(request).client.cancel, task_id)
    return back_to(f"/tasks/{task_id}", "cancelled")


async def retry(request: Request) -> Response:
    await checked_form(request)
    console = console_of(request)
    task_id = _int("task id", request.path_params["task_id"])
    outcome = await run_in_threadpool(retry_ids, console.engine, [task_id])
    if not outcome.retried:
        raise IllegalTransition(f"task {task_id} is {outcome.refused.get(task_id)}; only "
                                "FAILED or CANCELLED tasks can be retried")
    return back_to(f"/tasks/{task_id}", "retried")


ROUTES = [Route("/tasks", task_list, methods=["GET"]),
          Route("/tasks/{task_id}", task_page, methods=["GET"]),
          Route("/tasks/{task_id}/cancel", cancel, methods=["POST"]),
          Route("/tasks/{task_id}/retry", retry, methods=["POST"])]
