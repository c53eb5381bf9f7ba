"""``ax plan --peak-rate R --avg-ms D [--threads-per-node N] [--from-history TYPE [--since 1h]]``.

Capacity planning (:mod:`ax_kombu.core.planning`): the threads, worker nodes and queue
length a peak of R tasks a second, each running D ms on average, needs. With
``--from-history TYPE`` the average is measured instead: the runs of TYPE that finished
within ``--since`` (default 1h) in the attempt history (:mod:`ax_kombu.store.stats`); a
given ``--avg-ms`` is then ignored, and the output says so. Without ``--from-history``
nothing is read: the command needs no store.

Every error is one line on stderr: bad input (a rate or run time that is not a positive
number, neither ``--avg-ms`` nor ``--from-history``, a malformed option) exits 2; no
finished runs of TYPE in the window exits 3; an unreadable store exits 5.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.cli.base import Duration, settings_from
from ax_kombu.core import planning
from ax_kombu.core.cron import format_every
from ax_kombu.core.planning import DEFAULT_THREADS_PER_NODE, QUEUE_PER_THREAD, Plan
from ax_kombu.exceptions import AxError, StoreError, ValidationError
from ax_kombu.observability.redaction import redact_url
from ax_kombu.store import Store, db_now_ms
from ax_kombu.store.stats import RunTimes, run_times

_DEFAULT_SINCE_MS = 3_600_000


class NoRunHistory(AxError, LookupError):
    """The attempt history has no finished run of the task type in the window."""

    exit_code = 3


class _OneLineCommand(click.Command):
    """A command whose usage errors (a bad or missing option) are one line and exit 2."""

    def make_context(self, info_name: str | None, args: list[str],
                     parent: click.Context | None = None, **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else info_name
            click.echo(f"ax: error: {exc.format_message()} (see '{where} -h')", err=True)
            sys.exit(2)


def _history(ctx: click.Context, task_type: str, since_ms: int) -> RunTimes:
    settings = settings_from(ctx)
    store = Store(settings)
    try:
        with store.engine.connect() as conn:
            found = run_times(conn, task_type, db_now_ms(conn) - since_ms)
    except SQLAlchemyError as exc:
        raise StoreError(f"cannot read the store {redact_url(settings.database_url)}: "
                         f"{type(exc).__name__}") from None
    finally:
        store.close()
    if found is None:
        raise NoRunHistory(f"no finished runs of {task_type} in the last "
                           f"{format_every(since_ms)}")
    if found.avg_ms <= 0:
        raise ValidationError(f"the runs of {task_type} took under 1 ms on average; "
                              "give --avg-ms instead")
    return found


def _num(value: float) -> str:
    """``5.0`` → ``5``, ``3.3333`` → ``3.333``, ``0.00012`` → ``0.00012``."""
    if float(value).is_integer():
        return str(int(value))
    shown = f"{value:.3f}".rstrip("0").rstrip(".")
    return shown if shown != "0" else f"{value:.2g}"


def _as_json(result: Plan, history: RunTimes | None, since_ms: int) -> dict[str, Any]:
    shown: dict[str, Any] = {
        "threads": result.threads, "nodes": result.nodes, "queue_length": result.queue_length,
        "per_thread_rate": result.per_thread_rate, "peak_rate": result.peak_rate,
        "avg_ms": result.avg_ms, "threads_per_node": result.threads_per_node}
    if history is not None:
        shown["from_history"] = {"task_type": history.task_type, "runs": history.runs,
                                 "avg_ms": history.avg_ms, "p50_ms": history.p50_ms,
                                 "p99_ms": history.p99_ms, "since": format_every(since_ms)}
    return shown


def _print(result: Plan, history: RunTimes | None, since_ms: int,
           ignored_avg_ms: float | None) -> None:
    lines = [("peak rate", f"{_num(result.peak_rate)} tasks/s"),
             ("average run", f"{_num(result.avg_ms)} ms")]
    if history is not None:
        measured = (f"{history.runs} runs of {history.task_type} in the last "
                    f"{format_every(since_ms)}: p50 {history.p50_ms} ms, "
                    f"p99 {history.p99_ms} ms")
        lines.append(("measured", measured))
    if ignored_avg_ms is not None:
        lines.append(("note", f"--avg-ms {_num(ignored_avg_ms)} ignored: the history wins"))
    lines += [("per thread", f"{_num(result.per_thread_rate)} tasks/s"),
              ("threads", str(result.threads)),
              ("nodes", f"{result.nodes}  ({result.threads_per_node} threads each)"),
              ("queue length", f"{result.queue_length}  ({QUEUE_PER_THREAD} per thread)")]
    for label, value in lines:
        click.echo(f"{label:<13} {value}")


@click.command(cls=_OneLineCommand)
@click.option("--peak-rate", type=float, required=True, help="Tasks a second at the peak.")
@click.option("--avg-ms", type=float, default=None,
              help="Average run time of a task in ms (optional with --from-history).")
@click.option("--threads-per-node", type=int, default=DEFAULT_THREADS_PER_NODE,
              show_default=True, help="Tasks one worker node runs at once.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@click.option("--from-history", "task_type", default=None, metavar="TYPE",
              help="Measure the average run time of TYPE from the attempt history.")
@click.option("--since", "since_ms", type=Duration(), default=None,
              help="With --from-history: runs that finished within this long [default: 1h].")
@click.pass_context
def plan(ctx: click.Context, peak_rate: float, avg_ms: float | None, threads_per_node: int,
         as_json: bool, task_type: str | None, since_ms: int | None) -> None:
    """Threads, nodes and queue length for a peak load (capacity planning)."""
    if task_type is None and avg_ms is None:
        raise ValidationError("give --avg-ms D or --from-history TYPE")
    if task_type is None and since_ms is not None:
        raise ValidationError("--since needs --from-history TYPE")
    since = _DEFAULT_SINCE_MS if since_ms is None else since_ms
    if since <= 0:
        raise ValidationError("--since must be longer than 0")
    planning.validate(peak_rate, avg_ms, threads_per_node)  # before reading any history
    history = None if task_type is None else _history(ctx, task_type, since)
    measured = avg_ms if history is None else history.avg_ms
    assert measured is not None
    result = planning.plan(peak_rate, measured, threads_per_node)
    if as_json:
        click.echo(json.dumps(_as_json(result, history, since), indent=2))
    else:
        _print(result, history, since, avg_ms if history is not None else None)

