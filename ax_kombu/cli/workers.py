"""``ax workers [list]``, ``ax workers quiet NAME``, ``ax workers resume NAME``.

A quiet worker takes no new work: it finishes what runs, hands its received and staged
runs back (other workers run them), and keeps heartbeating (:mod:`ax_kombu.worker.quiet`).
``quiet`` and ``resume`` store the wish on the worker's row (``ax_node.quiet_at``); the
worker follows it within one heartbeat. NAME is a worker's node name, or the name of an
``ax-worker --processes N`` supervisor, which acts on its children ``NAME.1`` … ``NAME.N``.
An unknown or stopped name, or a scheduler's, is refused with one line (exit 2). Each
quiet and resume is recorded in the audit (``ax audit``).
"""

from __future__ import annotations

import json
from typing import Any

import click
from sqlalchemy import Row

from ax_kombu.cli.base import OneLineGroup, audited, settings_from
from ax_kombu.store import Store
from ax_kombu.store.engine import db_now_ms
from ax_kombu.store.nodes import live_nodes, set_quiet


def worker_state(row: Row[Any]) -> str:
    """``live``, ``quiet``, or the move under way: ``quieting`` (asked, not yet seen by its
    heartbeat) or ``resuming``."""
    quiet = bool(json.loads(row.info or "{}").get("quiet"))
    if row.quiet_at is not None:
        return "quiet" if quiet else "quieting"
    return "resuming" if quiet else "live"


def _view(row: Row[Any], now_ms: int) -> dict[str, Any]:
    info = json.loads(row.info or "{}")
    return {"node_id": row.node_id, "state": worker_state(row), "host": row.host,
            "pid": row.pid, "heartbeat_age_s": round((now_ms - row.heartbeat_at) / 1000, 1),
            "queues": info.get("queues", []), "free": info.get("free", {}),
            "running": info.get("running", 0), "quiet_at": row.quiet_at}


@click.group(cls=OneLineGroup, invoke_without_command=True)
@click.pass_context
def workers(ctx: click.Context) -> None:
    """Live workers (list), and quiet or resume one."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(list_workers)


@workers.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def list_workers(ctx: click.Context, as_json: bool = False) -> None:
    """Live workers: name, state (live, quiet), free slots, running tasks."""
    settings = settings_from(ctx)
    store = Store(settings)
    try:
        with store.engine.connect() as conn:
            now = db_now_ms(conn)
            found = [_view(r, now) for r in live_nodes(conn, settings.silence_ms)
                     if r.kind == "worker"]
    finally:
        store.close()
    if as_json:
        click.echo(json.dumps(found, indent=2))
        return
    if not found:
        click.echo("no live workers")
    for w in found:
        free = ", ".join(f"{q} {n}" for q, n in w["free"].items())
        click.echo(f"{w['node_id']}  {w['state']}  free {free or '-'}  running {w['running']}  "
                   f"beat {w['heartbeat_age_s']}s ago  pid {w['pid']} on {w['host']}")


def _set(ctx: click.Context, name: str, quiet: bool) -> list[str]:
    settings = settings_from(ctx)
    store = Store(settings)
    try:
        with store.engine.begin() as conn:
            names = set_quiet(conn, name, quiet, settings.silence_ms)
        audited(ctx, store.engine, "worker_quiet" if quiet else "worker_resume",
                f"worker:{name}", {"workers": names})
    finally:
        store.close()
    return names


@workers.command()
@click.argument("name")
@click.pass_context
def quiet(ctx: click.Context, name: str) -> None:
    """Make worker NAME take no new work: it finishes what runs and hands staged runs back."""
    for node in _set(ctx, name, True):
        click.echo(f"{node}: quiet (within one heartbeat)")


@workers.command()
@click.argument("name")
@click.pass_context
def resume(ctx: click.Context, name: str) -> None:
    """Make quiet worker NAME take work again."""
    for node in _set(ctx, name, False):
        click.echo(f"{node}: resumed (within one heartbeat)")
