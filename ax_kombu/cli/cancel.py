"""``ax cancel ID``, ``ax cancel --type T --biz-key K``, or in bulk
``ax cancel --type T [--status S] [--since 10m] [--biz-key K …] [--yes]``.

One task (by id, or by its type and one business key) is cancelled at once, or the
command says why not (no such task: exit 3; already finished: exit 4). The bulk form takes
``ax list``'s filters with their meanings, cancels every unfinished task that matches all
of them (:meth:`Client.cancel_many`, in short transactions), asks first unless ``--yes``,
and prints how many it cancelled.
"""

from __future__ import annotations

from typing import Any

import click

from ax_kombu.cli.base import audited, client_for
from ax_kombu.cli.list import biz_key_option, since_ms, since_option, status_option, type_option
from ax_kombu.exceptions import ValidationError
from ax_kombu.moving import cancel_selection
from ax_kombu.store.admin import parse_status


def _one_task(task_id: int | None, task_type: str | None, biz_keys: tuple[str, ...],
              status: str | None, since: str | None) -> bool:
    """True for the one-task forms (an id; a type with one key and no other filter).

    Raises:
        ValidationError: an id together with a filter, or no id and no filter.
    """
    filtered = bool(task_type or biz_keys or status or since)
    if task_id is not None:
        if filtered:
            raise ValidationError("give a task id, or --type/--biz-key/--status/--since, "
                                  "not both")
        return True
    if not (task_type or biz_keys):
        raise ValidationError("give a task id, or --type and/or --biz-key (ax cancel never "
                              "cancels every task)")
    return bool(task_type) and len(biz_keys) == 1 and not (status or since)


def _describe(task_type: str | None, biz_keys: tuple[str, ...], status: str | None,
              since: str | None) -> str:
    """The bulk selection in words, for the confirmation."""
    parts = [f"of type {task_type!r}" if task_type else "",
             f"with biz_key {', '.join(map(repr, biz_keys))}" if biz_keys else "",
             f"in status {status.upper()}" if status else "",
             f"created in the last {since}" if since else ""]
    return " ".join(p for p in parts if p)


@click.command()
@click.argument("task_id", type=int, required=False)
@type_option
@biz_key_option(multiple=True)
@status_option
@since_option
@click.option("--yes", "-y", is_flag=True, help="Bulk: do not ask first.")
@click.pass_context
def cancel(ctx: click.Context, task_id: int | None, task_type: str | None,
           biz_keys: tuple[str, ...], status: str | None, since: str | None,
           yes: bool) -> None:
    """Cancel a task that has not finished: by TASK_ID, or by --type and one --biz-key.

    With filters (--type, --biz-key…, --status, --since, meaning what they do in ax list)
    and no id: cancel every unfinished task that matches them all, after asking (--yes:
    without), and print how many.
    """
    if _one_task(task_id, task_type, biz_keys, status, since):
        with client_for(ctx) as client:
            view = (client.cancel(task_id) if task_id is not None
                    else client.cancel(task_type=task_type, biz_key=biz_keys[0]))
            audited(ctx, client.store.engine, "cancel", f"task:{view.task_id}")
        click.echo(f"{view.task_id} {view.status}")
        return
    _cancel_many(ctx, task_type, biz_keys, status, since, yes)


def _cancel_many(ctx: click.Context, task_type: str | None, biz_keys: tuple[str, ...],
                 status: str | None, since: str | None, yes: bool) -> None:
    age_ms = since_ms(since)
    filters: dict[str, Any] = {
        "task_type": task_type, "status": None if status is None else parse_status(status),
        "biz_keys": list(biz_keys) or None, "since": None if age_ms is None else age_ms / 1000}
    cancel_selection(0, **filters)  # a bad filter is refused before the question
    if not yes:
        click.confirm(f"Cancel every unfinished task "
                      f"{_describe(task_type, biz_keys, status, since)}?", abort=True)
    with client_for(ctx) as client:
        done = client.cancel_many(**filters)
        audited(ctx, client.store.engine, "cancel", f"tasks:{task_type or '*'}",
                {"cancelled": done, "status": status, "since": since,
                 "biz_keys": list(biz_keys) or None})
    click.echo(f"cancelled {done} task(s)")
