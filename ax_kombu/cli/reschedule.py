"""``ax reschedule ID|--type T --biz-key K --at ISO|--delay 10m|--now``

Moves a task that has not started to a new trigger time (:meth:`Client.reschedule`, or
:meth:`Client.run_now` for ``--now``) and prints its id, status and new trigger time (UTC).
``--at`` is an ISO 8601 time with its offset (``2026-12-24T20:00:00+08:00``, or ``Z`` for
UTC); a time without one is refused, never guessed. ``--delay`` is counted from now on the
database's clock. A task already claimed, staged for its start or running is not moved:
one line says so and the exit code is 4, as it is for a finished task.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import click

from ax_kombu.cli.base import Duration, IsoTime, audited, client_for
from ax_kombu.exceptions import ValidationError


def _check_form(task_id: int | None, task_type: str | None, biz_key: str | None,
                times_given: int) -> None:
    """Check that the command names one task one way, and gives it one new time.

    Raises:
        ValidationError: it does not.
    """
    if task_id is not None and (task_type or biz_key):
        raise ValidationError("give a task id, or --type with --biz-key, not both")
    if task_id is None and not (task_type and biz_key):
        raise ValidationError("give a task id, or both --type and --biz-key")
    if times_given != 1:
        raise ValidationError("give exactly one of --at, --delay and --now")


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


@click.command()
@click.argument("task_id", type=int, required=False)
@click.option("--type", "task_type", default=None, help="With --biz-key: the task's type.")
@click.option("--biz-key", default=None, help="With --type: the task's business key.")
@click.option("--at", "run_at", type=IsoTime(), default=None,
              help="Run at this ISO time with its offset, e.g. 2026-12-24T20:00:00+08:00.")
@click.option("--delay", type=Duration(), default=None,
              help="Run this long from now (500ms, 5s, 2m, 1h).")
@click.option("--now", is_flag=True, help="Run now (it becomes READY, due at once).")
@click.pass_context
def reschedule(ctx: click.Context, task_id: int | None, task_type: str | None,
               biz_key: str | None, run_at: datetime | None, delay: int | None,
               now: bool) -> None:
    """Move a task that has not started to a new time."""
    _check_form(task_id, task_type, biz_key,
                (run_at is not None) + (delay is not None) + now)
    named: dict[str, Any] = {"task_type": task_type, "biz_key": biz_key}
    with client_for(ctx) as client:
        if now:
            view = client.run_now(task_id, **named)
        else:
            view = client.reschedule(task_id, **named, run_at=run_at,
                                     delay=None if delay is None else timedelta(
                                         milliseconds=delay))
        audited(ctx, client.store.engine, "run_now" if now else "reschedule",
                f"task:{view.task_id}", {"trigger_time": _iso(view.trigger_time)})
    click.echo(f"{view.task_id} {view.status} {_iso(view.trigger_time)}")
