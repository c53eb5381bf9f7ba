"""The W3C trace context from the enqueue to the worker's run span (issue 39, OpenTelemetry).

On PostgreSQL and Redis, a scheduler and a worker in this process, with the SDK's in-memory
exporter: a producer span's context is stored with the task and carried in its message,
the worker's ``ax.run`` span is its child on the first run and linked to it on the retry,
and the scheduler's claim and publish batches have spans. Without an SDK, and without the
package, a task is stored without a trace context and runs (a script in a subprocess:
:mod:`tests.integration.tracing_app`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, Sampler, SamplingResult
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    StatusCode,
    TraceFlags,
    TraceState,
)
from sqlalchemy import select

from ax_kombu.config import Settings, from_env
from ax_kombu.core.states import Status
from ax_kombu.store.schema import tasks
from ax_kombu.worker.processors import Resolver

from . import tracing_app
from .harness import eventually, scheduler_running
from .test_worker import Dispatch, running

ROOT = Path(__file__).resolve().parents[2]


class _Gate(Sampler):
    """Samples only while a test of this module runs: the provider stays set for the rest
    of the process (it can be set once), and the other tests' spans are then dropped."""

    open = False

    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        return (ALWAYS_ON if self.open else ALWAYS_OFF).should_sample(*args, **kwargs)

    def get_description(self) -> str:
        return "the tracing tests' gate"


_GATE = _Gate()


@cache
def _exporter() -> InMemorySpanExporter:
    """The exporter of this process's SDK provider: the global provider can be set once per
    process, so it is set (or an SDK one already set is used) on first need, and kept."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider(sampler=_GATE)
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = _exporter()
    exporter.clear()
    _GATE.open = True
    try:
        yield exporter
    finally:
        _GATE.open = False
        exporter.clear()


@pytest.fixture
def settings(pg_url: str, redis_broker: dict[str, str]) -> Settings:
    return from_env({}, database_url=pg_url, retry_backoff_base_ms=200,
                    retry_backoff_max_ms=400, heartbeat_interval_s=0.2, worker_grace_s=10,
                    **redis_broker)


def _named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_the_run_span_is_the_producers_child_then_linked_on_the_retry(
        settings: Settings, dispatch: Dispatch, spans: InMemorySpanExporter) -> None:
    with trace.get_tracer("tests").start_as_current_span("P", kind=SpanKind.PRODUCER) as p:
        task_id = int(dispatch.client.enqueue("traced.close", {"fail_once": True}, max_retry=2))
    producer = p.get_span_context()
    view = dispatch.view(task_id)
    assert view.traceparent is not None
    assert view.traceparent.split("-")[1:3] == [f"{producer.trace_id:032x}",
                                               f"{producer.span_id:016x}"]
    assert view.trace_id == f"{producer.trace_id:032x}"
    resolver = Resolver(modules=[tracing_app.__name__])
    with running(settings, resolver=resolver), scheduler_running(settings):
        eventually(lambda: dispatch.status(task_id) is Status.SUCCESS, what="run twice")
    runs = sorted(_named(spans, "ax.run traced.close"), key=lambda s: s.start_time or 0)
    assert len(runs) == 2
    first, retry = runs
    assert first.kind is SpanKind.CONSUMER and first.parent is not None
    assert (first.context.trace_id, first.parent.span_id) == (producer.trace_id,
                                                               producer.span_id)
    assert first.status.status_code is StatusCode.ERROR
    assert [e.name for e in first.events] == ["exception"]
    assert dict(first.attributes or {}).items() >= {
        "messaging.system": "ax", "messaging.operation.type": "process",
        "messaging.destination.name": settings.queue_for("default"),
        "messaging.message.id": str(task_id), "ax.task.attempt": 1,
        "ax.task.retry_count": 0}.items()
    assert retry.parent is None and retry.context.trace_id != producer.trace_id
    assert [(link.context.trace_id, link.context.span_id) for link in retry.links] == [
        (producer.trace_id, producer.span_id)]
    assert retry.status.status_code is StatusCode.UNSET
    # the processor ran inside each run span, and its own span is the run span's child
    assert tracing_app.seen[task_id] == [(s.context.trace_id, s.context.span_id) for s in runs]
    bodies = _named(spans, "close.body")
    assert sorted((b.parent.span_id if b.parent else 0) for b in bodies) == sorted(
        s.context.span_id for s in runs)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_an_async_processor_runs_inside_its_run_span(
        settings: Settings, dispatch: Dispatch, spans: InMemorySpanExporter) -> None:
    with trace.get_tracer("tests").start_as_current_span("P") as p:
        task_id = int(dispatch.client.enqueue("traced.close_async", {}))
    with running(settings, resolver=Resolver(modules=[tracing_app.__name__])), \
            scheduler_running(settings):
        eventually(lambda: dispatch.status(task_id) is Status.SUCCESS, what="ran")
    (run,) = _named(spans, "ax.run traced.close_async")
    assert run.parent is not None and run.parent.span_id == p.get_span_context().span_id
    assert tracing_app.seen[task_id] == [(run.context.trace_id, run.context.span_id)]
    (body,) = [s for s in _named(spans, "close.body") if s.context.trace_id
               == run.context.trace_id]
    assert body.parent is not None and body.parent.span_id == run.context.span_id


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_the_scheduler_spans_its_claim_and_publish_batches(
        settings: Settings, dispatch: Dispatch, spans: InMemorySpanExporter) -> None:
    ids = [int(dispatch.client.enqueue("order.plain", {"i": i})) for i in range(5)]
    with scheduler_running(settings):
        eventually(lambda: sum(_size(s) for s in _named(spans, "ax.publish")) >= 5,
                   what="published")
    claims = _named(spans, "ax.claim")
    assert claims and all(s.kind is SpanKind.INTERNAL for s in claims)
    assert sum(_size(s) for s in claims) >= len(ids)
    assert all(dispatch.status(i) is Status.DISPATCHING for i in ids)


@pytest.mark.integration
def test_enqueue_many_stores_the_context_by_copy_and_by_insert(dispatch: Dispatch) -> None:
    context = SpanContext(trace_id=0xABC, span_id=0xDEF, is_remote=True,
                          trace_flags=TraceFlags(TraceFlags.SAMPLED),
                          trace_state=TraceState([("k", "v"), ("a", "b")]))
    with trace.use_span(NonRecordingSpan(context)):
        copied = dispatch.client.enqueue_many([{"task_type": "order.plain", "payload": {"i": i}}
                                               for i in range(25)])  # PostgreSQL: COPY
        inserted = dispatch.client.enqueue("order.plain", {"i": "one"})
    parent = f"00-{0xABC:032x}-{0xDEF:016x}-01"
    with dispatch.client.store.engine.connect() as conn:
        rows = conn.execute(select(tasks.c.traceparent, tasks.c.tracestate, tasks.c.trace_id)
                            .where(tasks.c.task_id.in_([int(i) for i in (*copied, inserted)])))
        assert {tuple(r) for r in rows} == {(parent, "k=v,a=b", f"{0xABC:032x}")}


def _size(span: ReadableSpan) -> Any:
    return (span.attributes or {}).get("messaging.batch.message_count", 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["no-sdk", "no-package"])
def test_without_an_sdk_or_the_package_a_task_has_no_trace_context_and_runs(
        mode: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "tests.integration.tracing_app", mode,
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=50, check=True)
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["status"] == "SUCCESS" and outcome["traceparent"] is None
    assert len(outcome["trace_id"]) == 32
    assert outcome["api"] is (mode == "no-sdk")
