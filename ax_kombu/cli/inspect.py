"""``ax inspect ID`` — one task, every field, its ended attempts (each with its outcome:
SUCCESS, FAILED, RETRY, SNOOZED, DISCARDED, CANCELLED, LOST, UNACKED) and the moves of its
trigger time (reschedule, run_now, a replacing enqueue); with ``--logs``, each attempt's own
log lines (:mod:`ax_kombu.worker.runlog`) and what their bounds cut."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from typing import Any

import click

from ax_kombu.api import Client
from ax_kombu.cli.base import settings_from
from ax_kombu.core.run_log import RunLog
from ax_kombu.exceptions import JobNotFound
from ax_kombu.store.run_logs import logs_of

_TIMES = ("trigger_time", "created_at", "dispatched_at", "started_at", "finished_at",
          "scheduled_at")


def _iso(ms: int | None) -> str | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC).isoformat(
        timespec="milliseconds")


@click.command()
@click.argument("task_id", type=int)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--logs", "with_logs", is_flag=True,
              help="Also each attempt's own log lines (all of them, not only the last).")
@click.pass_context
def inspect(ctx: click.Context, task_id: int, as_json: bool, with_logs: bool) -> None:
    """Show one task."""
    client = Client(settings_from(ctx))
    try:
        view = dataclasses.asdict(client.get(task_id))
        if view["job"] is not None:  # the strategy its job runs under (None: job removed)
            try:
                view["strategy"] = client.job(view["job"]).strategy
            except JobNotFound:
                view["strategy"] = None
        logs = logs_of(client.store.engine, task_id) if with_logs else None
    finally:
        client.close()
    view["status"] = str(view["status"])
    for name in _TIMES:
        view[name] = _iso(view[name])
    history = [a._asdict() for a in view.pop("attempts")]
    for attempt in history:
        for name in ("trigger_time", "dispatched_at", "started_at", "finished_at"):
            attempt[name] = _iso(attempt[name])
    moved = [m._asdict() for m in view.pop("moves")]
    for move in moved:
        for name in ("moved_at", "from_time", "to_time"):
            move[name] = _iso(move[name])
    if as_json:
        whole = {**view, "attempts": history, "moves": moved}
        if logs is not None:
            whole["logs"] = {str(n): _log_json(log) for n, log in logs.items()}
        click.echo(json.dumps(whole, indent=2, ensure_ascii=False))
        return
    if view.pop("archived"):
        click.echo(f"{'archived':>15}: yes (in ax_task_archive; ax archive / AX_RETENTION)")
    for key, value in view.items():
        shown = json.dumps(value, ensure_ascii=False) if key in ("payload", "result") else value
        click.echo(f"{key:>15}: {'' if shown is None else shown}")
    _print_attempts(history)
    _print_moves(moved)
    if logs is not None:
        _print_logs(logs)


def _print_attempts(history: list[dict[str, Any]]) -> None:
    """The attempt history as a table (``ax_attempt``)."""
    click.echo(f"{'attempts':>15}: {len(history) or 'none ended yet'}")
    for a in history:
        took = f"{a['duration_ms']} ms" if a["duration_ms"] is not None else "not started"
        line = (f"  #{a['attempt']:<3} {a['outcome']:<9} {a['node'] or '-':<20} "
                f"ended {a['finished_at']}  {took}")
        click.echo(line + (f"  {a['error']}" if a["error"] else ""))


def _print_moves(moved: list[dict[str, Any]]) -> None:
    """The moves of its trigger time (``ax_move``): when, from → to, by what."""
    click.echo(f"{'moves':>15}: {len(moved) or 'none'}")
    for m in moved:
        click.echo(f"  {m['moved_at']}  {m['from_time']} → {m['to_time']}  {m['kind']:<10} "
                   f"(attempt {m['attempt']})")


def _log_json(log: RunLog) -> dict[str, Any]:
    return {"lines": [{**line.as_json(), "t": _iso(line.t)} for line in log.lines],
            "cut": log.cut}


def _print_logs(logs: dict[int, RunLog]) -> None:
    """Each attempt's own log lines: time, level, logger, message; then what was cut."""
    click.echo(f"{'logs':>15}: {'by attempt' if logs else 'none kept'}")
    for attempt, log in logs.items():
        click.echo(f"  #{attempt}: {len(log.lines)} lines")
        for line in log.lines:
            text = line.msg.replace("\n", "\n      ")
            click.echo(f"    {_iso(line.t)} {line.level:<8} {line.logger}: {text}")
        if log.cut:
            click.echo(f"    ({log.cut})")
