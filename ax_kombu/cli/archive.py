"""``ax archive --older-than 7d [--to FILE.jsonl.gz]`` — move finished tasks out of the hot
tables, with their attempt history.

Into ``ax_task_archive`` / ``ax_attempt_archive``, or appended to a gzip JSONL file (one
object per task, its ``attempts`` a list), in short transactions of ``--batch`` tasks that
never block the schedulers' claims. Stopped anywhere, a run loses nothing and the next one
carries on (a file may then hold the last batch twice: dedupe by ``task_id``). See
:mod:`ax_kombu.store.archive` for the guarantees; ``AX_RETENTION`` makes the schedulers do
this continuously.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from ax_kombu.cli.base import audited, settings_from
from ax_kombu.config import parse_duration_ms
from ax_kombu.store import Store
from ax_kombu.store.admin import BATCH_MAX, check_count
from ax_kombu.store.archive import BATCH_DEFAULT, Pace, archive_finished


@click.command()
@click.option("--older-than", required=True,
              help="Only tasks that finished longer ago than this (7d, 12h).")
@click.option("--to", "to", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="Append to this gzip JSONL file instead of the archive tables.")
@click.option("--batch", default=BATCH_DEFAULT, show_default=True, type=int,
              help="Tasks moved per transaction.")
@click.option("--limit", default=None, type=int, help="Move at most this many tasks.")
@click.option("--pause", default="0", show_default=True,
              help="Pause between batches (e.g. 20ms): a slower run, a lighter load.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def archive(ctx: click.Context, older_than: str, to: Path | None, batch: int,
            limit: int | None, pause: str, as_json: bool) -> None:
    """Move finished tasks older than a duration, and their attempts, out of the hot tables."""
    age_ms = parse_duration_ms(older_than)
    pace = Pace(pause_s=parse_duration_ms(pause) / 1000)
    check_count("--batch", batch, BATCH_MAX)
    if limit is not None:
        check_count("--limit", limit)
    store = Store(settings_from(ctx))
    started = time.monotonic()
    try:
        done = archive_finished(store.engine, age_ms, batch=batch, limit=limit, to=to,
                                pace=pace)
        audited(ctx, store.engine, "archive", "tasks:finished",
                {"older_than": older_than, "to": str(to) if to else None, "tasks": done.tasks,
                 "attempts": done.attempts, "audit": done.audit})
    finally:
        store.close()
    seconds = time.monotonic() - started
    where = str(to) if to is not None else "ax_task_archive"
    if as_json:
        click.echo(json.dumps({"older_than_ms": age_ms, "to": where, "tasks": done.tasks,
                               "attempts": done.attempts, "batches": done.batches,
                               "audit": done.audit,
                               "seconds": round(seconds, 3)}, indent=2))
        return
    click.echo(f"archived {done.tasks} task(s) and {done.attempts} attempt row(s) to {where} "
               f"in {seconds:.1f} s")
    if done.audit:
        click.echo(f"archived {done.audit} audit record(s) to ax_audit_archive")
