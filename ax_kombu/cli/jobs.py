"""``ax jobs list|add|pause|resume|run|remove|next`` — recurring jobs (:mod:`ax_kombu.recurring`).

Times are shown in ISO 8601 with their offset, in the job's own zone. Every error is one
line on stderr (``ax: error: …``): bad input — a bad cron expression, an unknown zone,
both or neither of ``--cron``/``--every``, a malformed option — exits 2 and writes
nothing; an unknown job name exits 3.

A job no scheduler can plan (its stored row cannot be parsed) is shown as ``broken`` in
``ax jobs list``, its reason on a line below the table (a ``"broken"`` key in ``--json``,
present only then).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import click

from ax_kombu.cli.base import Duration, JsonValue, OneLineGroup, audited, client_for
from ax_kombu.config import PRIORITIES
from ax_kombu.core.cron import MISFIRE_POLICIES
from ax_kombu.core.values import STRATEGIES
from ax_kombu.exceptions import ValidationError
from ax_kombu.recurring import JobView

_COLUMNS = ("name", "schedule", "task type", "misfire", "strategy", "paused", "next fire")


def _iso(at: datetime | None) -> str | None:
    if at is None:
        return None
    return at.isoformat(timespec="milliseconds" if at.microsecond else "seconds")


def _as_json(job: JobView) -> dict[str, Any]:
    out = {"name": job.name, "task_type": job.task_type, "cron": job.cron,
           "every_s": job.every.total_seconds() if job.every is not None else None,
           "tz": job.tz, "misfire": job.misfire, "misfire_grace_s": job.misfire_grace_s,
           "strategy": job.strategy, "priority": job.priority, "paused": job.paused,
           "next_fire_at": _iso(job.next_fire_at), "payload": job.payload}
    if job.broken is not None:
        out["broken"] = job.broken
    return out


def _next(job: JobView) -> str:
    """The "next fire" cell: the time, or why there is none."""
    if job.broken is not None:
        return "broken"
    return _iso(job.next_fire_at) or "-"


def _summary(job: JobView) -> str:
    """``report.daily: cron '0 8 * * *' Asia/Shanghai, next 2026-12-04T08:00:00+08:00``"""
    if job.broken is not None:
        when = f"broken: {job.broken}"
    else:
        when = "paused" if job.paused else f"next {_iso(job.next_fire_at) or 'never'}"
    return f"{job.name}: {job.schedule}, {when}"


@click.group(cls=OneLineGroup)
def jobs() -> None:
    """Recurring jobs: list, add, pause, resume, remove, next."""


@jobs.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
@click.pass_context
def list_jobs(ctx: click.Context, as_json: bool) -> None:
    """Every recurring job, by name."""
    with client_for(ctx) as client:
        found = client.jobs()
    if as_json:
        click.echo(json.dumps([_as_json(j) for j in found], indent=2, ensure_ascii=False))
        return
    if not found:
        click.echo("(no recurring jobs)")
        return
    rows = [_COLUMNS] + [(j.name, j.schedule, j.task_type, j.misfire, j.strategy,
                          "yes" if j.paused else "no", _next(j))
                         for j in found]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    for job in found:
        if job.broken is not None:
            click.echo(f"{job.name} is broken: {job.broken}; set it again (ax jobs add, "
                       "ax.schedule) to have it planned")


@jobs.command()
@click.argument("name")
@click.argument("task_type")
@click.option("--cron", "cron_expr", default=None,
              help="Cron expression, 5 fields or 6 with seconds first: '0 8 * * *'.")
@click.option("--every", type=Duration(), default=None, help="Fixed interval: 30s, 5m, 1h.")
@click.option("--tz", default="UTC", show_default=True, help="IANA zone of the cron expression.")
@click.option("--payload", type=JsonValue(), default="null", help="JSON payload of each task.")
@click.option("--misfire", type=click.Choice(MISFIRE_POLICIES), default=MISFIRE_POLICIES[0],
              show_default=True, help="What to do with occurrences missed during downtime.")
@click.option("--strategy", type=click.Choice(STRATEGIES), default="parallel", show_default=True,
              help="An occurrence due while the previous one runs: run both (parallel), wait "
                   "(serial), replace it (cover) or drop the new one (discard).")
@click.option("--grace", type=Duration(), default=None,
              help="Missed occurrences older than this are skipped (default: no limit).")
@click.option("--priority", type=click.Choice(PRIORITIES), default="default", show_default=True)
@click.option("--max-retry", type=int, default=None)
@click.option("--timeout", "timeout_ms", type=Duration(), default=None, help="e.g. 30s")
@click.option("--processor", default=None, help="Registered name or package.module:function.")
@click.option("--callback-url", default=None, help="POST the payload to this URL instead.")
@click.pass_context
def add(ctx: click.Context, /, name: str, task_type: str, payload: Any, cron_expr: str | None,
        every: int | None, grace: int | None, **options: Any) -> None:
    """Create or update the recurring job NAME (exactly one of --cron or --every)."""
    if (cron_expr is None) == (every is None):
        raise ValidationError(f"job {name!r}: give exactly one of --cron or --every")
    with client_for(ctx) as client:
        job = client.schedule(name, task_type, payload, cron=cron_expr,
                              every=None if every is None else every / 1000.0,
                              misfire_grace_s=None if grace is None else grace / 1000.0,
                              **options)
        audited(ctx, client.store.engine, "job_add", f"job:{name}",
                {"schedule": job.schedule, "task_type": task_type})
    click.echo(_summary(job))


@jobs.command()
@click.argument("name")
@click.pass_context
def pause(ctx: click.Context, name: str) -> None:
    """Pause NAME: its undispatched occurrences are removed, none is created."""
    with client_for(ctx) as client:
        job = client.pause(name)
        audited(ctx, client.store.engine, "job_pause", f"job:{name}")
    click.echo(_summary(job))


@jobs.command()
@click.argument("name")
@click.pass_context
def resume(ctx: click.Context, name: str) -> None:
    """Resume NAME; what it missed goes by its misfire policy."""
    with client_for(ctx) as client:
        job = client.resume(name)
        audited(ctx, client.store.engine, "job_resume", f"job:{name}")
    click.echo(_summary(job))


@jobs.command()
@click.argument("name")
@click.pass_context
def run(ctx: click.Context, name: str) -> None:
    """Run NAME once, now: one occurrence due at once, gated by its strategy as a
    scheduled one is (paused or not). Prints the new task's id."""
    with client_for(ctx) as client:
        task_id = client.run_job_now(name)
        audited(ctx, client.store.engine, "job_run", f"job:{name}", {"task_id": task_id})
    click.echo(f"{name}: task {task_id} due now")


@jobs.command()
@click.argument("name")
@click.pass_context
def remove(ctx: click.Context, name: str) -> None:
    """Remove NAME and its undispatched occurrences."""
    with client_for(ctx) as client:
        dropped = client.unschedule(name)
        audited(ctx, client.store.engine, "job_remove", f"job:{name}", {"removed": dropped})
    click.echo(f"{name}: removed ({dropped} undispatched occurrence"
               f"{'' if dropped == 1 else 's'})")


@jobs.command("next")
@click.argument("name")
@click.option("-n", "--count", type=int, default=5, show_default=True)
@click.pass_context
def next_fires(ctx: click.Context, name: str, count: int) -> None:
    """The next fire times of NAME, one per line (paused or not)."""
    with client_for(ctx) as client:
        times = client.next_fires(name, count)
    for at in times:
        click.echo(_iso(at))
