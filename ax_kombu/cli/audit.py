"""``ax audit [--since 1d] [--limit N] [--json]`` — the record of operator actions, newest
first (:mod:`ax_kombu.store.audit`): when, who, from where, what and on what.

``--since`` counts back from the database's clock, the clock the records are stamped with.
Records moved to ``ax_audit_archive`` by ``ax archive`` or ``AX_RETENTION`` are not shown.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import click

from ax_kombu.cli.base import settings_from
from ax_kombu.config import parse_duration_ms
from ax_kombu.store import Store
from ax_kombu.store.audit import READ_MAX, Entry, now_ms, read_since

_COLUMNS = ("at", "actor", "via", "action", "target", "detail")


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def _view(entry: Entry) -> dict[str, Any]:
    return {"id": entry.id, "at": _iso(entry.at), "actor": entry.actor, "via": entry.via,
            "action": entry.action, "target": entry.target, "detail": entry.detail}


def _cells(entry: Entry) -> tuple[str, ...]:
    detail = json.dumps(entry.detail, ensure_ascii=False, sort_keys=True) if entry.detail \
        else "-"
    return (_iso(entry.at), entry.actor, entry.via, entry.action, entry.target, detail)


@click.command()
@click.option("--since", default="1d", show_default=True,
              help="Only actions this long ago or later (30m, 12h, 7d).")
@click.option("--limit", default=500, show_default=True, type=click.IntRange(1, READ_MAX),
              help=f"Show at most this many (up to {READ_MAX}).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_context
def audit(ctx: click.Context, since: str, limit: int, as_json: bool) -> None:
    """The record of operator actions (console and CLI), newest first."""
    age_ms = parse_duration_ms(since)
    store = Store(settings_from(ctx))
    try:
        entries = read_since(store.engine, now_ms(store.engine) - age_ms, limit=limit)
    finally:
        store.close()
    if as_json:
        click.echo(json.dumps([_view(e) for e in entries], indent=2, ensure_ascii=False))
        return
    if not entries:
        click.echo(f"(no recorded action in the last {since})")
        return
    rows = [_COLUMNS, *map(_cells, entries)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    for row in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
