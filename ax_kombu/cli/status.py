"""``ax status`` — live nodes, queue depths, and tasks by status.

A node is live when it heartbeated within ``heartbeat_misses ×
heartbeat_interval_s`` and did not stop. Each queue shows how many live
workers consume it (a quiet worker, ``ax workers quiet``, does not, and shows
``QUIET``); a queue nobody consumes shows how many tasks wait for it
(``slow: no consumer, 120 waiting``): the scheduler does not re-publish to it. Paused task
types and queues show with how many tasks each holds back (``paused  type sms.send (40
waiting, by alice)``). Passwords and query-string values in any URL shown (store,
broker, or inside a node's heartbeat info) are replaced by ``***``.
"""

from __future__ import annotations

import json
from typing import Any

import click
from sqlalchemy.exc import SQLAlchemyError

from ax_kombu.broker.connection import queue_depths
from ax_kombu.cli.base import broker_option, settings_from
from ax_kombu.config import PRIORITIES, Settings
from ax_kombu.core.states import Status
from ax_kombu.exceptions import StoreError
from ax_kombu.observability.redaction import redact_url
from ax_kombu.store import Store, gates, pauses
from ax_kombu.store.console import EXACT_UP_TO, task_counts
from ax_kombu.store.engine import db_now_ms
from ax_kombu.store.nodes import live_nodes
from ax_kombu.store.recovery import oldest_overdue_ms, waiting_without_consumer
from ax_kombu.store.stats import schedule_delays

#: the window of the schedule delay figures
DELAY_WINDOW_MS = 5 * 60_000


def _redacted(value: Any) -> Any:
    """``value`` with every string that looks like a URL redacted, recursively."""
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, dict):
        return {k: _redacted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redacted(v) for v in value]
    return value


def _store_view(settings: Settings) -> dict[str, Any]:
    store = Store(settings)
    try:
        with store.engine.connect() as conn:
            now = db_now_ms(conn)
            rows = live_nodes(conn, settings.silence_ms)
            counts, estimated = task_counts(conn)
            consumers = _consumers(settings, rows)
            waiting = waiting_without_consumer(conn, [p for p, n in consumers.items() if not n])
            parked = gates.parked_by_type(conn)
            limits = gates.list_limits(conn)
            overdue_ms = oldest_overdue_ms(conn, now)
            delays = schedule_delays(conn, now - DELAY_WINDOW_MS)
            paused = _paused(conn, settings)
    except SQLAlchemyError as exc:
        raise StoreError(f"cannot read the store {redact_url(settings.database_url)}: "
                         f"{type(exc).__name__}") from None
    finally:
        store.close()
    found = [{"node_id": r.node_id, "kind": r.kind, "host": r.host, "pid": r.pid,
              "heartbeat_age_s": round((now - r.heartbeat_at) / 1000, 1),
              "info": _redacted(json.loads(r.info or "{}"))} for r in rows]
    return {"nodes": found, "tasks": {str(s): int(counts.get(str(s), 0)) for s in Status},
            "tasks_estimated": sorted(estimated),
            "consumers": consumers, "waiting_without_consumer": waiting,
            "limits": limits, "waiting_for_key_or_limit": parked, "paused": paused,
            "free_slots": _free_slots(rows), "oldest_overdue_s": overdue_ms / 1000.0,
            "schedule_delay_5m": None if delays is None else {
                "dispatches": delays.dispatches, "p50_ms": delays.p50_ms,
                "p99_ms": delays.p99_ms}}


def _paused(conn: Any, settings: Settings) -> list[dict[str, Any]]:
    """Each pause, with how many claimable tasks it holds back."""
    found = pauses.list_pauses(conn)
    by_queue = {settings.queue_for(p): p for p in PRIORITIES}
    waiting = pauses.waiting_by_pause(conn, found, by_queue.get)
    return [{"kind": p.kind, "name": p.name, "paused_at": p.paused_at, "actor": p.actor,
             "waiting": waiting[p.kind, p.name]} for p in found]


def _free_slots(rows: list[Any]) -> dict[str, int]:
    """Per queue (priority), the free slots the live workers last reported."""
    found = dict.fromkeys(PRIORITIES, 0)
    for row in rows:
        if row.kind == "worker":
            free = json.loads(row.info or "{}").get("free", {})
            for priority in PRIORITIES:
                found[priority] += int(free.get(priority, 0))
    return found


def _consumers(settings: Settings, rows: list[Any]) -> dict[str, int]:
    """Per priority, how many live workers report consuming its queue (a quiet one does not
    consume)."""
    found = dict.fromkeys(PRIORITIES, 0)
    for row in rows:
        if row.kind != "worker" or row.quiet_at is not None:
            continue
        queues = json.loads(row.info or "{}").get("queues", [])
        for priority in PRIORITIES:
            found[priority] += settings.queue_for(priority) in queues
    return found


def _queue_depths(settings: Settings) -> dict[str, Any]:
    """Messages waiting in each queue, or why the broker could not be asked."""
    try:
        return dict(queue_depths(settings))
    except Exception as exc:  # noqa: BLE001 - status must still show the rest
        return {"error": f"broker unreachable: {type(exc).__name__}"}


def _pools(info: dict[str, Any]) -> str:
    pools, free, backlog = info.get("pools", {}), info.get("free", {}), info.get("backlog", {})
    stuck = info.get("stuck", {})
    parts = []
    for name in pools:
        part = f"{name} {free.get(name, '?')}/{pools[name]} free"
        if backlog.get(name):
            part += f", {backlog[name]} waiting"
        if stuck.get(name):
            part += f", {stuck[name]} stuck"
        parts.append(part)
    return "; ".join(parts)


def _describe(node: dict[str, Any]) -> str:
    info = node["info"]
    if node["kind"] == "worker":
        quiet = "QUIET (takes no new work; ax workers resume)  " if info.get("quiet") else ""
        return (f"{quiet}queues {','.join(info.get('queues', []))}  pools {_pools(info)}  "
                f"running {info.get('running', 0)}")
    shown = {k: v for k, v in info.items() if not isinstance(v, (dict, list))}
    return "  ".join(f"{k} {v}" for k, v in shown.items())


def _print(view: dict[str, Any]) -> None:
    click.echo(f"store   {view['store']}")
    click.echo(f"broker  {view['broker']}")
    click.echo("")
    if not view["nodes"]:
        click.echo("no live nodes")
    for node in view["nodes"]:
        click.echo(f"{node['kind']:<9} {node['node_id']}  host {node['host']}  pid {node['pid']}  "
                   f"beat {node['heartbeat_age_s']}s ago")
        detail = _describe(node)
        if detail:
            click.echo(f"          {detail}")
    click.echo("")
    queues = view["queues"]
    click.echo("queues  " + (queues["error"] if "error" in queues else
                             "  ".join(f"{p} {queues[p]}" for p in PRIORITIES)))
    click.echo("workers " + "  ".join(_consumed(view, p) for p in PRIORITIES))
    click.echo("free    " + "  ".join(f"{p} {view['free_slots'][p]}" for p in PRIORITIES)
               + " slots")
    delays = view["schedule_delay_5m"]
    click.echo(f"late    oldest overdue {view['oldest_overdue_s']:.1f} s; schedule delay "
               + ("(no dispatch in 5 min)" if delays is None else
                  f"p50 {delays['p50_ms']} ms, p99 {delays['p99_ms']} ms over "
                  f"{delays['dispatches']} dispatches in 5 min"))
    rough = set(view.get("tasks_estimated", ()))
    click.echo("tasks   " + "  ".join(f"{s} {'~' if s in rough else ''}{n}"
                                      for s, n in view["tasks"].items()))
    if rough:
        click.echo(f"        (~: estimated, more than {EXACT_UP_TO:,} each; from the "
                   "database's statistics)")
    if view["limits"]:
        click.echo("limits  " + "  ".join(f"{t} {n}" for t, n in view["limits"].items()))
    if view["paused"]:
        click.echo("paused  " + "  ".join(f"{p['kind']} {p['name']} ({p['waiting']} waiting, "
                                          f"by {p['actor']})" for p in view["paused"]))
    if view["waiting_for_key_or_limit"]:
        click.echo("waiting for an order key or a limit (READY, parked)  " + "  ".join(
            f"{t} {n}" for t, n in view["waiting_for_key_or_limit"].items()))


def _consumed(view: dict[str, Any], priority: str) -> str:
    count = view["consumers"][priority]
    if count:
        return f"{priority} {count}"
    return f"{priority}: no consumer, {view['waiting_without_consumer'].get(priority, 0)} waiting"


@click.command()
@broker_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--no-broker", is_flag=True, help="Do not ask the broker for queue depths.")
@click.pass_context
def status(ctx: click.Context, broker_url: str | None, as_json: bool, no_broker: bool) -> None:
    """Live schedulers and workers, queue depths, and tasks by status."""
    settings = settings_from(ctx, broker_url=broker_url)
    view = {"store": redact_url(settings.database_url),
            "broker": redact_url(settings.broker_url), **_store_view(settings),
            "queues": {"error": "not asked (--no-broker)"} if no_broker
            else _queue_depths(settings)}
    if as_json:
        click.echo(json.dumps(view, indent=2))
    else:
        _print(view)
