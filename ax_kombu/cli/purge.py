"""``ax purge --status S --older-than 7d`` — delete old finished tasks and their history.

Deletes in short transactions of ``--batch`` tasks each, so it never holds
locks long and can run beside live schedulers and workers.
"""

from __future__ import annotations

import json

import click

from ax_kombu.cli.base import audited, settings_from
from ax_kombu.config import parse_duration_ms
from ax_kombu.core.states import FINAL, Status
from ax_kombu.store import Store
from ax_kombu.store.admin import BATCH_MAX, check_count, parse_status, purge_finished

_FINAL = tuple(s for s in Status if s in FINAL)


@click.command()
@click.option("--status", required=True, help="SUCCESS, FAILED or CANCELLED.")
@click.option("--older-than", required=True,
              help="Only tasks that finished longer ago than this (7d, 12h).")
@click.option("--batch", default=1000, show_default=True, type=int,
              help="Tasks deleted per transaction.")
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def purge(ctx: click.Context, status: str, older_than: str, batch: int, dry_run: bool,
          as_json: bool) -> None:
    """Delete finished tasks older than a duration, with their attempt history."""
    final = parse_status(status, _FINAL)
    age_ms = parse_duration_ms(older_than)
    check_count("--batch", batch, BATCH_MAX)
    store = Store(settings_from(ctx))
    try:
        done = purge_finished(store.engine, final, age_ms, batch=batch, dry_run=dry_run)
        if not dry_run:
            audited(ctx, store.engine, "purge", f"tasks:{final}",
                    {"older_than": older_than, "tasks": done.tasks,
                     "attempts": done.attempts})
    finally:
        store.close()
    if as_json:
        click.echo(json.dumps({"status": str(final), "older_than_ms": age_ms,
                               "dry_run": dry_run, "tasks": done.tasks,
                               "attempts": done.attempts}, indent=2))
        return
    verb = "would delete" if dry_run else "deleted"
    click.echo(f"{verb} {done.tasks} {final} task(s) and {done.attempts} attempt row(s)")
