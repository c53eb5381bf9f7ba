"""``ax pause-type TYPE`` / ``ax resume-type TYPE``, ``ax queues list|pause NAME|resume
NAME``, and ``ax pauses`` (what is paused, since when, by whom).

A pause is cluster-wide and stored (``ax_pause``): every scheduler leaves the type's or the
queue's tasks waiting, unclaimed and visibly late, until it is lifted; runs already
claimed are not recalled (:mod:`ax_kombu.store.pauses`). A queue is named as configured
(``AX_QUEUE_HIGH``/``_DEFAULT``/``_SLOW``). Each change is in the audit record, as the OS
user or ``ax --as NAME``.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import click

from ax_kombu.cli.base import OneLineGroup, actor_of, client_for
from ax_kombu.config import PRIORITIES


def _set(ctx: click.Context, kind: str, name: str, on: bool) -> None:
    """Pause or resume one type or queue, and say what happened."""
    with client_for(ctx) as client:
        method = {("type", True): client.pause_type, ("type", False): client.resume_type,
                  ("queue", True): client.pause_queue,
                  ("queue", False): client.resume_queue}[kind, on]
        changed = method(name, actor=actor_of(ctx), via="cli")
    state = "paused" if on else "resumed"
    click.echo(f"{kind} {name}: {state}" if changed else
               f"{kind} {name}: {'already paused' if on else 'was not paused'}")


@click.command("pause-type")
@click.argument("task_type")
@click.pass_context
def pause_type(ctx: click.Context, task_type: str) -> None:
    """Pause TASK_TYPE cluster-wide: its tasks wait, unclaimed, until ax resume-type."""
    _set(ctx, "type", task_type, True)


@click.command("resume-type")
@click.argument("task_type")
@click.pass_context
def resume_type(ctx: click.Context, task_type: str) -> None:
    """Lift the pause of TASK_TYPE: its waiting tasks are claimed and run, each once."""
    _set(ctx, "type", task_type, False)


@click.group(cls=OneLineGroup)
def queues() -> None:
    """The queues: list them, pause or resume one cluster-wide."""


@queues.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def list_queues(ctx: click.Context, as_json: bool) -> None:
    """Each priority's queue name, and whether it is paused."""
    with client_for(ctx) as client:
        paused = {p.name: p for p in client.pauses() if p.kind == "queue"}
        names = {p: client.settings.queue_for(p) for p in PRIORITIES}
    found = [{"priority": p, "queue": q, "paused": q in paused,
              "paused_by": paused[q].actor if q in paused else None} for p, q in names.items()]
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    for row in found:
        click.echo(f"{row['priority']:<8} {row['queue']}"
                   + (f"  PAUSED by {row['paused_by']}" if row["paused"] else ""))


@queues.command("pause")
@click.argument("name")
@click.pass_context
def pause_queue(ctx: click.Context, name: str) -> None:
    """Pause the queue NAME cluster-wide: its tasks wait, unclaimed, until resumed."""
    _set(ctx, "queue", name, True)


@queues.command("resume")
@click.argument("name")
@click.pass_context
def resume_queue(ctx: click.Context, name: str) -> None:
    """Lift the pause of the queue NAME."""
    _set(ctx, "queue", name, False)


@click.command("pauses")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def pauses(ctx: click.Context, as_json: bool) -> None:
    """Every paused task type and queue: since when, by whom."""
    with client_for(ctx) as client:
        found = client.pauses()
    if as_json:
        click.echo(json.dumps([{"kind": p.kind, "name": p.name, "paused_at": p.paused_at,
                                "actor": p.actor} for p in found], indent=2))
        return
    if not found:
        click.echo("(nothing paused)")
    for p in found:
        since = datetime.fromtimestamp(p.paused_at / 1000, UTC).strftime("%Y-%m-%d %H:%M:%SZ")
        click.echo(f"{p.kind:<6} {p.name}  since {since}  by {p.actor}")


#: the commands this module adds to ``ax``
COMMANDS = (pause_type, resume_type, queues, pauses)
