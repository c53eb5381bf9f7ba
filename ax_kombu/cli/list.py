"""``ax list`` — tasks, newest first, filtered by status, type, business key and age."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import click

from ax_kombu.cli.base import settings_from
from ax_kombu.config import parse_duration_ms
from ax_kombu.store import Store
from ax_kombu.store.admin import LIST_DEFAULT, LIST_MAX, TaskFilter, parse_status
from ax_kombu.store.admin import list_tasks as select_tasks

FC = TypeVar("FC", bound=Callable[..., Any])

_COLUMNS = ("id", "type", "status", "trigger", "attempt", "owner_node", "last_error")
_ERROR_WIDTH = 60


def _iso(ms: int | None) -> str | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC).isoformat(
        timespec="milliseconds")


def _view(row: Any) -> dict[str, Any]:
    return {"task_id": row.task_id, "task_type": row.task_type, "status": row.status,
            "trigger_time": _iso(row.trigger_time), "attempt": row.attempt,
            "retry_count": row.retry_count, "owner_node": row.owner_node,
            "last_error": row.last_error, "biz_key": row.biz_key,
            "created_at": _iso(row.created_at), "finished_at": _iso(row.finished_at)}


def _cells(view: dict[str, Any]) -> tuple[str, ...]:
    error = " ".join((view["last_error"] or "").split())  # one line per task
    if len(error) > _ERROR_WIDTH:
        error = error[:_ERROR_WIDTH - 1] + "…"
    return (str(view["task_id"]), view["task_type"], view["status"], view["trigger_time"],
            str(view["attempt"]), view["owner_node"] or "-", error or "-")


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in rows]


#: the filters ``ax list`` shares with ``ax cancel`` (same flags, same meanings)
status_option = click.option("--status", default=None, help="Only tasks in this status.")
type_option = click.option("--type", "task_type", default=None, help="Only tasks of this type.")
since_option = click.option("--since", default=None,
                            help="Only tasks created this long ago or later (1h, 2d).")


def biz_key_option(multiple: bool = False) -> Callable[[FC], FC]:
    """``--biz-key``: one key (``ax list``), or a key per flag (``multiple``)."""
    if multiple:
        return click.option("--biz-key", "biz_keys", multiple=True,
                            help="Only the tasks with this business key (repeat for more).")
    return click.option("--biz-key", default=None, help="Only the task with this business key.")


def since_ms(since: str | None) -> int | None:
    """``--since`` in ms (None: not given).

    Raises:
        ConfigurationError: not a duration.
    """
    return None if since is None else parse_duration_ms(since)


@click.command("list")
@status_option
@type_option
@biz_key_option()
@since_option
@click.option("--limit", default=LIST_DEFAULT, show_default=True, type=int,
              help=f"Show at most this many (up to {LIST_MAX}).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def list_tasks(ctx: click.Context, status: str | None, task_type: str | None,
               biz_key: str | None, since: str | None, limit: int, as_json: bool) -> None:
    """List tasks, newest first."""
    wanted = TaskFilter(status=None if status is None else parse_status(status),
                        task_type=task_type, biz_key=biz_key,
                        since_ms=since_ms(since),
                        limit=limit)
    store = Store(settings_from(ctx))
    try:
        views = [_view(r) for r in select_tasks(store.engine, wanted)]
    finally:
        store.close()
    if as_json:
        click.echo(json.dumps(views, indent=2, ensure_ascii=False))
    elif views:
        click.echo("\n".join(_table([_COLUMNS, *map(_cells, views)])))
