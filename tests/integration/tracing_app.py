"""Processors of the tracing tests (loaded by the worker's resolver), and a script that
enqueues and runs one task on the embedded stores without OpenTelemetry.

``python -m tests.integration.tracing_app MODE DIR``: MODE ``no-sdk`` (the API importable,
no SDK configured) or ``no-package`` (``opentelemetry`` cannot be imported). It enqueues a
task on a SQLite store and ax's SQLite transport in DIR, runs a scheduler and a worker in
threads until the task ends, and prints one JSON line: the task's status, traceparent and
trace id, and whether the API was importable.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import ax_kombu as ax
from ax_kombu.core.context import Context

#: task_id → the trace context current in its processor (trace id, span id), per run
seen: dict[int, list[tuple[int, int]]] = {}
_lock = threading.Lock()


@ax.processor("traced.close")
def close(payload: Any, ctx: Context) -> None:
    """Records the current span and runs a span of its own; fails its first run when
    ``payload["fail_once"]``."""
    from opentelemetry import trace

    span = trace.get_current_span().get_span_context()
    with _lock:
        seen.setdefault(ctx.task_id, []).append((span.trace_id, span.span_id))
    with trace.get_tracer("tests").start_as_current_span("close.body"):
        if payload.get("fail_once") and ctx.retry_count == 0:
            raise RuntimeError("the first run fails")


@ax.processor("traced.close_async")
async def close_async(payload: Any, ctx: Context) -> None:
    """As :func:`close`, an ``async def`` one (run on the worker's event loop)."""
    import asyncio

    from opentelemetry import trace

    await asyncio.sleep(0)
    span = trace.get_current_span().get_span_context()
    with _lock:
        seen.setdefault(ctx.task_id, []).append((span.trace_id, span.span_id))
    with trace.get_tracer("tests").start_as_current_span("close.body"):
        await asyncio.sleep(0)


@ax.processor("order.plain")
def plain(payload: Any, ctx: Context) -> None:
    """Imports nothing of OpenTelemetry."""


def _main(mode: str, directory: str) -> None:
    if mode == "no-package":
        sys.modules["opentelemetry"] = None  # type: ignore[assignment]
    import json

    from ax_kombu.api import Client
    from ax_kombu.config import from_env
    from ax_kombu.core.states import FINAL
    from ax_kombu.observability import tracing
    from ax_kombu.scheduler.node import Scheduler
    from ax_kombu.worker.node import Worker
    from ax_kombu.worker.processors import Resolver
    from tests.waiting import eventually

    settings = from_env({}, database_url=f"sqlite:///{directory}/ax.sqlite3",
                        broker_url=f"ax+sqlite:///{directory}/broker.sqlite3",
                        heartbeat_interval_s=0.2, auto_migrate=True)
    client = Client(settings)
    task_id = client.enqueue("order.plain", {"mode": mode})
    worker = Worker(settings, resolver=Resolver(modules=[__name__]))
    scheduler = Scheduler(settings)
    threads = [threading.Thread(target=d.run, daemon=True) for d in (worker, scheduler)]
    for thread in threads:
        thread.start()
    eventually(lambda: client.get(task_id).status in FINAL, what="the task ended")
    view = client.get(task_id)
    worker.request_stop()
    scheduler.request_stop()
    for thread in threads:
        thread.join(30)
    print(json.dumps({"status": view.status.value, "traceparent": view.traceparent,
                      "trace_id": view.trace_id, "api": tracing.available()}))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
