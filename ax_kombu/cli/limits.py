"""``ax limits list|set TYPE N|clear TYPE`` — cluster-wide concurrency limits per task type.

At most N tasks of the type are DISPATCHING or RUNNING at once across the whole cluster;
the others wait READY and start as runs end (:mod:`ax_kombu.store.gates`).
"""

from __future__ import annotations

import json

import click

from ax_kombu.cli.base import OneLineGroup, audited, client_for


@click.group(cls=OneLineGroup)
def limits() -> None:
    """Cluster-wide concurrency limits per task type: list, set, clear."""


@limits.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object: type → limit.")
@click.pass_context
def list_limits(ctx: click.Context, as_json: bool) -> None:
    """Every limit, by task type."""
    with client_for(ctx) as client:
        found = client.limits()
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    if not found:
        click.echo("(no limits)")
    for task_type, n in found.items():
        click.echo(f"{task_type}  {n}")


@limits.command("set")
@click.argument("task_type")
@click.argument("max_running", type=click.IntRange(min=1))
@click.pass_context
def set_limit(ctx: click.Context, task_type: str, max_running: int) -> None:
    """At most MAX_RUNNING tasks of TASK_TYPE running at once, cluster-wide."""
    with client_for(ctx) as client:
        client.set_limit(task_type, max_running)
        audited(ctx, client.store.engine, "limit_set", f"type:{task_type}",
                {"max_running": max_running})
    click.echo(f"{task_type}: at most {max_running} at once")


@limits.command()
@click.argument("task_type")
@click.pass_context
def clear(ctx: click.Context, task_type: str) -> None:
    """Remove the limit of TASK_TYPE (waiting tasks start)."""
    with client_for(ctx) as client:
        client.set_limit(task_type, None)
        audited(ctx, client.store.engine, "limit_clear", f"type:{task_type}")
    click.echo(f"{task_type}: no limit")
