"""``ax enqueue TYPE --payload JSON [--delay 5s | --at ISO]``"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import click

from ax_kombu.api import Client
from ax_kombu.cli.base import Duration, IsoTime, JsonValue, settings_from
from ax_kombu.config import PRIORITIES


@click.command()
@click.argument("task_type")
@click.option("--payload", type=JsonValue(), default="null", help="JSON payload.")
@click.option("--delay", type=Duration(), default=None, help="Run after this long (5s, 2m, …).")
@click.option("--at", "run_at", type=IsoTime(), default=None,
              help="Run at this ISO time with a zone, e.g. 2026-12-24T20:00:00+08:00.")
@click.option("--priority", type=click.Choice(PRIORITIES), default="default", show_default=True)
@click.option("--biz-key", default=None, help="Idempotency key, unique per task type.")
@click.option("--unique", type=click.Choice(["always", "pending"]), default="always",
              show_default=True, help="Hold the biz key for good, or only while pending.")
@click.option("--on-conflict", type=click.Choice(["keep", "replace"]), default="keep",
              show_default=True,
              help="replace: a pending task with the biz key takes this payload and time.")
@click.option("--max-retry", type=int, default=None)
@click.option("--timeout", "timeout_ms", type=Duration(), default=None, help="e.g. 30s")
@click.option("--processor", default=None, help="Registered name or package.module:function.")
@click.option("--callback-url", default=None, help="POST the payload to this URL instead.")
@click.option("--order-key", default=None,
              help="Run one at a time with the other tasks of this key, in trigger order.")
@click.option("--order-policy", type=click.Choice(["hold_failed", "skip_failed"]),
              default="hold_failed", show_default=True,
              help="Whether a failed task waiting for its retry holds its key.")
@click.option("--shards", default=None, metavar="N|workers",
              help="Make N shards of the task (1..1024), or one per live worker of its queue.")
@click.pass_context
def enqueue(ctx: click.Context, /, task_type: str, payload: Any, delay: int | None,
            run_at: datetime | None, **options: Any) -> None:
    """Schedule one task and print its id."""
    shards = options.get("shards")
    if shards is not None and shards.isdigit():
        options["shards"] = int(shards)  # else "workers", or a bad value the library names
    client = Client(settings_from(ctx))
    try:
        task_id = client.enqueue(task_type, payload, run_at=run_at,
                                 delay=None if delay is None else delay / 1000.0, **options)
    finally:
        client.close()
    suffix = ("" if task_id.created else "  (replaced: the pending task took this payload "
              "and time)" if task_id.replaced else "  (duplicate: existing task, nothing created)")
    click.echo(f"{' '.join(map(str, task_id.shards)) or int(task_id)}{suffix}")
