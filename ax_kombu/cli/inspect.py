"""``ax inspect ID`` — one task, every field."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime

import click

from ax_kombu.api import Client
from ax_kombu.cli.base import settings_from
from ax_kombu.exceptions import JobNotFound

_TIMES = ("trigger_time", "created_at", "dispatched_at", "started_at", "finished_at",
          "scheduled_at")


def _iso(ms: int | None) -> str | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC).isoformat(
        timespec="milliseconds")


@click.command()
@click.argument("task_id", type=int)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def inspect(ctx: click.Context, task_id: int, as_json: bool) -> None:
    """Show one task."""
    client = Client(settings_from(ctx))
    try:
        view = dataclasses.asdict(client.get(task_id))
        if view["job"] is not None:  # the strategy its job runs under (None: job removed)
            try:
                view["strategy"] = client.job(view["job"]).strategy
            except JobNotFound:
                view["strategy"] = None
    finally:
        client.close()
    view["status"] = str(view["status"])
    for name in _TIMES:
        view[name] = _iso(view[name])
    if as_json:
        click.echo(json.dumps(view, indent=2, ensure_ascii=False))
        return
    for key, value in view.items():
        shown = json.dumps(value, ensure_ascii=False) if key == "payload" else value
        click.echo(f"{key:>15}: {'' if shown is None else shown}")
