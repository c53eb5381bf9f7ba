"""``ax retry ID…`` or ``ax retry --type T --status FAILED|CANCELLED`` — run again, now.

A retried task goes back to READY, due at once; it keeps its ``retry_count``
and ``last_error``, and its earlier attempts stay in the history.
"""

from __future__ import annotations

import json

import click

from ax_kombu.cli.base import audited, settings_from
from ax_kombu.config import parse_duration_ms
from ax_kombu.exceptions import IllegalTransition, ValidationError
from ax_kombu.store import Store
from ax_kombu.store.admin import (
    RETRYABLE,
    Retried,
    check_count,
    parse_status,
    retry_ids,
    retry_matching,
)


def _refused(outcome: Retried) -> str:
    return ", ".join(f"{i} ({why})" for i, why in outcome.refused.items())


def _target(task_ids: tuple[int, ...], retried: list[int], task_type: str | None) -> str:
    """``task:ID`` for one task, else the selection."""
    if task_ids and len(retried) == 1:
        return f"task:{retried[0]}"
    return f"tasks:{','.join(map(str, retried))}" if task_ids else f"tasks:{task_type}"


def _check_form(task_ids: tuple[int, ...], task_type: str | None, status: str | None,
                since: str | None, limit: int | None) -> None:
    if task_ids and (task_type or status or since or limit is not None):
        raise ValidationError("give task ids, or --type and --status, not both")
    if not task_ids and not (task_type and status):
        raise ValidationError("give task ids, or --type and --status (FAILED or CANCELLED)")


@click.command()
@click.argument("task_ids", nargs=-1, type=int)
@click.option("--type", "task_type", default=None, help="Bulk: tasks of this type.")
@click.option("--status", default=None, help="Bulk: tasks in this status (FAILED or CANCELLED).")
@click.option("--since", default=None, help="Bulk: only tasks that ended this long ago or later.")
@click.option("--limit", default=None, type=int, help="Bulk: retry at most this many.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def retry(ctx: click.Context, task_ids: tuple[int, ...], task_type: str | None,
          status: str | None, since: str | None, limit: int | None, as_json: bool) -> None:
    """Put FAILED or CANCELLED tasks back to READY, due now."""
    _check_form(task_ids, task_type, status, since, limit)
    wanted = None if status is None else parse_status(status, RETRYABLE)
    since_ms = None if since is None else parse_duration_ms(since)
    if limit is not None:
        check_count("--limit", limit)
    store = Store(settings_from(ctx))
    try:
        if task_ids:
            outcome = retry_ids(store.engine, task_ids)
        else:
            assert task_type is not None and wanted is not None
            outcome = retry_matching(store.engine, task_type, wanted, since_ms=since_ms,
                                     limit=limit)
        if outcome.retried:
            audited(ctx, store.engine, "retry", _target(task_ids, outcome.retried, task_type),
                    {"retried": len(outcome.retried), "status": status, "since": since})
    finally:
        store.close()
    if task_ids and not outcome.retried:
        raise IllegalTransition(f"nothing retried; only FAILED or CANCELLED tasks can be: "
                                f"{_refused(outcome)}")
    if as_json:
        click.echo(json.dumps({"retried": outcome.retried,
                               "not_retried": {str(i): w for i, w in outcome.refused.items()}},
                              indent=2))
        return
    click.echo(f"retried {len(outcome.retried)} task(s)")
    if outcome.refused:
        click.echo(f"not retried: {_refused(outcome)}")
