"""The overview: live nodes and their lanes, queue depths, tasks by status, the oldest
overdue task, and the last hour's lateness — the figures of ``ax status``, read through the
same store functions. ``/overview/live`` is the part the page's script refetches every
few seconds. An operator quiets a worker there, or resumes it (``POST
/workers/{name}/quiet`` and ``/resume``: :func:`ax_kombu.store.nodes.set_quiet`, as ``ax
workers quiet`` does, and recorded in the audit)."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Row
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ax_kombu.broker.connection import queue_depths
from ax_kombu.config import PRIORITIES, Settings
from ax_kombu.observability.redaction import redact_url
from ax_kombu.store.console import started_since, tasks_by_status
from ax_kombu.store.engine import db_now_ms
from ax_kombu.store.nodes import live_nodes, set_quiet
from ax_kombu.store.recovery import oldest_overdue_ms
from ax_kombu.web import charts
from ax_kombu.web.console import OPERATE, Console, audited, back_to, checked_form, console_of

#: the most starts per status the charts read (the newest; see started_since)
SERIES_MOST = 20_000


def node_view(row: Row[Any], now_ms: int) -> dict[str, Any]:
    """A live node as the page shows it; URLs in its heartbeat info redacted."""
    info = json.loads(redact_url(row.info or "{}"))
    pools = info.get("pools", {})
    lanes = [{"name": name, "size": size, "free": info.get("free", {}).get(name, "?"),
              "backlog": info.get("backlog", {}).get(name, 0)} for name, size in pools.items()]
    return {"node_id": row.node_id, "kind": row.kind, "incarnation": row.incarnation,
            "host": row.host, "pid": row.pid,
            "heartbeat_age_s": round((now_ms - row.heartbeat_at) / 1000, 1),
            "queues": info.get("queues", []), "lanes": lanes,
            "state": _state(row.quiet_at is not None, bool(info.get("quiet")))}


def _state(asked: bool, quiet: bool) -> str:
    """A worker's ``live`` or ``quiet``, or the move under way (``quieting``: asked, not yet
    seen by its heartbeat; ``resuming``)."""
    if asked:
        return "quiet" if quiet else "quieting"
    return "resuming" if quiet else "live"


def _depths(settings: Settings) -> dict[str, Any]:
    """Messages waiting per queue, or why the broker could not be asked."""
    try:
        return {"depths": queue_depths(settings)}
    except Exception as exc:  # noqa: BLE001 - the page must still show the rest
        return {"error": f"broker unreachable: {type(exc).__name__}"}


def _chart(lateness: charts.Lateness) -> dict[str, Any]:
    late_top = charts.top(lateness.p99_ms)
    rate_top = charts.top(lateness.started_per_s)
    return {"width": charts.WIDTH, "height": charts.HEIGHT, "starts": lateness.starts,
            "late_top": late_top, "rate_top": rate_top,
            "p50": charts.polyline(lateness.p50_ms, late_top),
            "p99": charts.polyline(lateness.p99_ms, late_top),
            "rate": charts.polyline(lateness.started_per_s, rate_top)}


def snapshot(console: Console) -> dict[str, Any]:
    """Everything the live part of the overview shows."""
    with console.engine.connect() as conn:
        now = db_now_ms(conn)
        nodes = [node_view(r, now) for r in live_nodes(conn, console.settings.silence_ms)]
        counts = tasks_by_status(conn)
        overdue_ms = oldest_overdue_ms(conn, now)
        pairs = started_since(conn, now - charts.WINDOW_MS, now, SERIES_MOST)
    return {"nodes": nodes, "counts": counts, "overdue_s": overdue_ms / 1000,
            "queues": _depths(console.settings), "priorities": PRIORITIES,
            "chart": _chart(charts.lateness(pairs, now)), "sampled": len(pairs) >= SERIES_MOST}


def overview(request: Request) -> Response:
    console = console_of(request)
    return console.page(request, "overview.html", **snapshot(console))


def live(request: Request) -> Response:
    console = console_of(request)
    return console.page(request, "_live.html", **snapshot(console))


async def quiet(request: Request) -> Response:
    """Ask a worker (or a supervisor's children) to take no new work."""
    return await _set_quiet(request, True)


async def resume(request: Request) -> Response:
    """Ask a quiet worker to take work again."""
    return await _set_quiet(request, False)


async def _set_quiet(request: Request, on: bool) -> Response:
    await checked_form(request, OPERATE)
    console = console_of(request)
    name = request.path_params["name"]

    def change() -> list[str]:
        with console.engine.begin() as conn:
            return set_quiet(conn, name, on, console.settings.silence_ms)
    names = await run_in_threadpool(change)
    await audited(request, "worker_quiet" if on else "worker_resume", f"worker:{name}",
                  {"workers": names})
    return back_to("/", "quiet" if on else "resumed")


ROUTES = [Route("/", overview, methods=["GET"]),
          Route("/overview/live", live, methods=["GET"]),
          Route("/workers/{name}/quiet", quiet, methods=["POST"]),
          Route("/workers/{name}/resume", resume, methods=["POST"])]
