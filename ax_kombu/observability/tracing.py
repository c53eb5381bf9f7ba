"""OpenTelemetry: the W3C trace context from the enqueue to the worker's run span.

What travels: the ``traceparent``/``tracestate`` current when a task is enqueued
(:func:`current_context_headers`) is stored with its row, read back by the scheduler's claim
and carried in its message (headers and body), so the worker's run span
(:func:`run_span`, ``ax.run <task_type>``, kind CONSUMER) is the producer's child on the
first attempt and linked to it on a retry, as the messaging semantic conventions have it.
The scheduler wraps each claim and publish batch in a span of its own (:func:`batch_span`).

Contracts:

* Optional: ``opentelemetry-api`` (the ``ax_kombu[otel]`` extra) is imported on first use,
  once; without it every function here is a no-op, and nothing fails.
* No cost without an SDK: while no tracer provider is configured (the API's proxy), no span
  is started and nothing is captured (the API's current span is then invalid).
* A span never decides an outcome: it records the processor's exception (ERROR status)
  and re-raises it; an ``ax.Retry`` or ``ax.Snooze`` is an event, not an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import cache
from typing import TYPE_CHECKING, Any, Protocol

from ax_kombu.core.errors import Retry, Snooze

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

#: the instrumentation scope ax's spans are made under
TRACER_NAME = "ax_kombu"
#: ``messaging.system`` of ax's spans (not one of the conventions' well-known brokers)
MESSAGING_SYSTEM = "ax"
#: the longest ``tracestate`` a task row stores (a longer one is dropped, not cut)
MAX_TRACESTATE = 512
#: the length of a version-00 ``traceparent`` (the row's column)
TRACEPARENT_LENGTH = 55

_NOTHING = (None, None)


class Traced(Protocol):
    """What a run span reads of a started task (:class:`ax_kombu.worker.task.RunTask`)."""

    @property
    def task_id(self) -> int: ...
    @property
    def attempt(self) -> int: ...
    @property
    def task_type(self) -> str: ...
    @property
    def priority(self) -> str: ...
    @property
    def retry_count(self) -> int: ...
    @property
    def traceparent(self) -> str | None: ...
    @property
    def tracestate(self) -> str | None: ...


class _Otel:
    """The OpenTelemetry API, imported (only built when it imports)."""

    def __init__(self) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.trace = trace
        self.propagator = TraceContextTextMapPropagator()
        self.proxy = trace.ProxyTracerProvider

    def tracer(self) -> Tracer | None:
        """ax's tracer, or None while no SDK's provider is set (the API's proxy)."""
        provider = self.trace.get_tracer_provider()
        if isinstance(provider, self.proxy):
            return None
        return _tracer(provider)


@cache
def _tracer(provider: Any) -> Tracer:
    """ax's tracer from ``provider`` (one per provider: a test may set another)."""
    tracer: Tracer = provider.get_tracer(TRACER_NAME)
    return tracer


@cache
def _otel() -> _Otel | None:
    """The API, or None when ``opentelemetry`` cannot be imported (tried once)."""
    try:
        return _Otel()
    except ImportError:
        return None


def available() -> bool:
    """Whether the OpenTelemetry API can be imported (an SDK may still be missing)."""
    return _otel() is not None


def current_context_headers() -> tuple[str | None, str | None]:
    """The current span's W3C trace context, to be stored with a task enqueued now.

    Returns:
        ``(traceparent, tracestate)``: ``(None, None)`` without the API or without a valid
        current span (no SDK configured: the API's span is invalid); ``tracestate`` is None
        when empty or longer than :data:`MAX_TRACESTATE`.
    """
    otel = _otel()
    if otel is None or not otel.trace.get_current_span().get_span_context().is_valid:
        return _NOTHING
    carrier: dict[str, str] = {}
    otel.propagator.inject(carrier)
    parent = carrier.get("traceparent")
    if parent is None or len(parent) != TRACEPARENT_LENGTH:
        return _NOTHING
    state = carrier.get("tracestate") or None
    if state is not None and len(state) > MAX_TRACESTATE:
        state = None
    return parent, state


def trace_id_of(traceparent: str) -> str:
    """The 32 hex digits of ``traceparent``'s trace id (a task's display ``trace_id``)."""
    return traceparent[3:35]


def batch_span(name: str, size: int) -> AbstractContextManager[Any]:
    """An INTERNAL span ``name`` around one scheduler batch of ``size`` tasks (attribute
    ``messaging.batch.message_count``); a null context without an SDK."""
    otel = _otel()
    tracer = otel.tracer() if otel is not None else None
    if tracer is None:
        return nullcontext()
    return tracer.start_as_current_span(name, attributes={
        "messaging.system": MESSAGING_SYSTEM, "messaging.batch.message_count": size})


def run_scopes(queue_for: Callable[[str], str]) -> list[Callable[[Traced, Any],
                                                                 AbstractContextManager[Any]]]:
    """The worker's tracing run scopes: :func:`run_scope` when an SDK's provider is set
    as the worker is built (an ``-A`` module, or the app embedding the worker, sets it up
    first), else none, so an untraced worker pays nothing per run."""
    otel = _otel()
    return [run_scope(queue_for)] if otel is not None and otel.tracer() is not None else []


def run_scope(queue_for: Callable[[str], str]) -> Callable[[Traced, Any],
                                                           AbstractContextManager[Any]]:
    """A worker run scope (:data:`ax_kombu.worker.scopes.RunScope`): :func:`run_span`, its
    ``messaging.destination.name`` the queue of the task's priority (``queue_for``)."""
    def scope(task: Traced, ctx: Any) -> AbstractContextManager[Any]:
        del ctx
        return run_span(task, queue_for(task.priority))
    return scope


def run_span(task: Traced, queue: str) -> AbstractContextManager[Any]:
    """The span ``ax.run <task_type>`` (kind CONSUMER) around one run, current while it
    runs (sync thread or asyncio task alike: context variables), so the processor's own
    spans are its children.

    Its parent is the task's ``traceparent`` on the first attempt (``retry_count`` 0); a
    retry's span starts from the worker's current context (a new trace) and links to it.
    A null context without an SDK.
    """
    otel = _otel()
    tracer = otel.tracer() if otel is not None else None
    if tracer is None or otel is None:
        return nullcontext()
    return _run_span(otel, tracer, task, queue)


@contextmanager
def _run_span(otel: _Otel, tracer: Tracer, task: Traced, queue: str) -> Iterator[None]:
    trace = otel.trace
    parent = _extracted(otel, task)
    first = task.retry_count == 0
    links = []
    if parent is not None and not first:
        links.append(trace.Link(trace.get_current_span(parent).get_span_context()))
    with tracer.start_as_current_span(
            f"ax.run {task.task_type}", context=parent if first else None,
            kind=trace.SpanKind.CONSUMER, links=links, attributes=_run_attributes(task, queue),
            record_exception=False, set_status_on_exception=False) as span:
        try:
            yield
        except (Retry, Snooze) as directive:
            span.add_event(f"ax.{type(directive).__name__.lower()}",
                           {"ax.reason": str(directive)})
            raise
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}"))
            raise


def _extracted(otel: _Otel, task: Traced) -> Any:
    """The task's stored context as an OpenTelemetry context (None: none stored, or not a
    valid one)."""
    if task.traceparent is None:
        return None
    carrier = {"traceparent": task.traceparent}
    if task.tracestate is not None:
        carrier["tracestate"] = task.tracestate
    context = otel.propagator.extract(carrier, context=_empty_context())
    if not otel.trace.get_current_span(context).get_span_context().is_valid:
        return None
    return context


def _empty_context() -> Any:
    from opentelemetry.context import Context

    return Context()


def _run_attributes(task: Traced, queue: str) -> Mapping[str, str | int]:
    return {"messaging.system": MESSAGING_SYSTEM, "messaging.operation.type": "process",
            "messaging.operation.name": "run", "messaging.destination.name": queue,
            "messaging.message.id": str(task.task_id), "ax.task.type": task.task_type,
            "ax.task.attempt": task.attempt, "ax.task.priority": task.priority,
            "ax.task.retry_count": task.retry_count}
