"""The wire format: one JSON message per task attempt, readable by a plain Kombu consumer.

A message says which task and which attempt is due; the attempt is the fencing
token a worker checks against the row. The trace id also travels in the headers, and so
does the W3C trace context stored at enqueue (``traceparent``, ``tracestate``: absent when
the task has none; :mod:`ax_kombu.observability.tracing`), which the body carries too
(the worker reads the body).

Version 2 (what ax publishes) carries only what the row cannot tell the worker
before it fences the task: ``task_id``, ``attempt``, ``trigger_time``,
``priority``, ``trace_id``, and who dispatched it when (``dispatched_at``,
``node``)::

    {"v":2,"task_id":7,"attempt":1,"trigger_time":1764892800000,"priority":"default",
     "trace_id":"…","dispatched_at":1764892799750,"node":"scheduler@host",
     "traceparent":"00-…-…-01"}

No payload, processor or callback URL crosses the broker: the worker's RUNNING
move returns them from the row, and that is what runs. Version 1 (every field
of the row's task, payload included) is still accepted, so messages published
by an older scheduler run after an upgrade (upgrade workers first).

Two records, one per side: the scheduler publishes a :class:`ClaimedTask` (the
claimed row by name, who dispatched it, where to), and a worker parses a body
into a :class:`TaskMessage` (the fields a version-1 message carries; a
version-2 one fills only its own). Both write the same version-2 body.
"""

from __future__ import annotations

from dataclasses import dataclass
from json.encoder import encode_basestring as _encode_string
from typing import Any, NamedTuple, Protocol

from ax_kombu.broker.rejects import Rejected
from ax_kombu.config import PRIORITIES

MESSAGE_VERSION = 2
#: the full message of earlier versions (payload and all), still accepted
FULL_VERSION = 1


class RawJson(str):
    """A payload that is still the JSON text the task row stores (unparsed)."""


def _js(value: str | None) -> str:
    return "null" if value is None else _encode_string(value)


class Sendable(Protocol):
    """What the publisher sends (:mod:`ax_kombu.broker.publisher`): a :class:`ClaimedTask`,
    or a :class:`TaskMessage` built by hand. Its id and attempt make the delivery tag, its
    route (else its priority's queue) the queue, and :meth:`to_json` the body."""

    @property
    def task_id(self) -> int: ...
    @property
    def attempt(self) -> int: ...
    @property
    def trace_id(self) -> str: ...
    @property
    def priority(self) -> str: ...
    @property
    def route(self) -> str | None: ...

    def to_json(self) -> str: ...


class _Sent(Protocol):
    """The fields a version-2 message carries (:data:`SLIM_FIELDS`)."""

    @property
    def task_id(self) -> int: ...
    @property
    def attempt(self) -> int: ...
    @property
    def trace_id(self) -> str: ...
    @property
    def trigger_time(self) -> int: ...
    @property
    def priority(self) -> str: ...
    @property
    def dispatched_at(self) -> int: ...
    @property
    def node(self) -> str: ...
    @property
    def traceparent(self) -> str | None: ...
    @property
    def tracestate(self) -> str | None: ...


def _json(m: _Sent) -> str:
    """The JSON body of ``m`` (version 2: no payload; see the module docstring), built
    directly: the scheduler builds tens of thousands a second."""
    return (f'{{"v":{MESSAGE_VERSION},"task_id":{m.task_id:d},"attempt":{m.attempt:d},'
            f'"trigger_time":{m.trigger_time:d},"priority":{_js(m.priority)},'
            f'"trace_id":{_js(m.trace_id)},"dispatched_at":{m.dispatched_at:d},'
            f'"node":{_js(m.node)}{_trace_context(m)}}}')


def _trace_context(m: _Sent) -> str:
    """The body's trace context fields (each absent when None), after a comma."""
    if m.traceparent is None:
        return ""
    if m.tracestate is None:
        return f',"traceparent":{_js(m.traceparent)}'
    return f',"traceparent":{_js(m.traceparent)},"tracestate":{_js(m.tracestate)}'


def headers_of(m: Sendable) -> dict[str, str]:
    """The message headers of ``m``: its ``trace_id``, and its W3C trace context where it
    has one (the names of W3C Trace Context, which tracing instrumentations read)."""
    headers = {"trace_id": m.trace_id}
    parent = getattr(m, "traceparent", None)
    if parent is not None:
        headers["traceparent"] = parent
        state = getattr(m, "tracestate", None)
        if state is not None:
            headers["tracestate"] = state
    return headers


@dataclass(kw_only=True, slots=True)
class ClaimedTask:
    """One claimed attempt as the scheduler's dispatcher publishes it: the claim's RETURNING
    row read by name (:func:`ax_kombu.scheduler.dispatcher.to_message`), who dispatched it
    and when, and where to. Only the fields of a version-2 message are sent
    (:meth:`to_json`); the rest serve a Celery-bound task's message
    (:mod:`ax_kombu.broker.celery_wire`, whose subclasses mark its runner) and the
    publish hooks."""

    task_id: int
    attempt: int
    task_type: str
    #: the stored JSON text
    payload: RawJson
    trace_id: str
    trigger_time: int
    timeout_ms: int
    priority: str
    retry_count: int
    max_retry: int
    processor: str | None
    callback_url: str | None
    #: when it was published (the scheduler's database clock, epoch ms)
    dispatched_at: int
    #: the scheduler node that claimed and published it
    node: str
    #: the queue to publish to when not the priority's (a worker's own queue)
    route: str | None = None
    #: the W3C trace context stored at enqueue (None: enqueued without a trace)
    traceparent: str | None = None
    tracestate: str | None = None

    def to_json(self) -> str:
        """The JSON body (version 2: no payload; see the module docstring)."""
        return _json(self)


class TaskMessage(NamedTuple):
    """A message as a worker parses it (:meth:`from_body`): the fields a version-1 message
    carries, of which a version-2 message sends :data:`SLIM_FIELDS` (the others are then
    placeholders: the row's values are what runs). A NamedTuple: a worker parses tens of
    thousands a second."""

    task_id: int
    attempt: int
    task_type: str
    payload: Any
    trace_id: str
    trigger_time: int
    timeout_ms: int
    priority: str
    retry_count: int
    max_retry: int
    processor: str | None
    callback_url: str | None
    dispatched_at: int
    node: str
    #: the W3C trace context the message carried (None: none; not in version 1)
    traceparent: str | None = None
    tracestate: str | None = None

    @property
    def route(self) -> str | None:
        """None: a message built by hand is published to its priority's queue."""
        return None

    def to_json(self) -> str:
        """The JSON body (version 2: no payload; see the module docstring)."""
        return _json(self)

    @property
    def slim(self) -> bool:
        """Received as a version-2 message: only :data:`SLIM_FIELDS` came from the wire."""
        return self.payload is NOT_SENT

    @classmethod
    def from_body(cls, body: Any) -> TaskMessage:
        """Parse a received body, strictly: every field present, of its type, within range.

        Integers are ``int`` (not ``bool``, not a numeric string), strings are
        ``str`` no longer than the task table's column, ``attempt`` and
        ``timeout_ms`` are at least 1, ``priority`` is a known one. Keys not
        listed are ignored (a newer version may add some).

        Raises:
            Rejected: (a ``ValueError``) the body is not an ax task message; its
                ``reason`` says why (:mod:`ax_kombu.broker.rejects`).
        """
        version = body.get("v") if type(body) is dict else None
        if version == MESSAGE_VERSION:
            try:
                message = cls(task_id=body["task_id"], attempt=body["attempt"], task_type="",
                              payload=NOT_SENT, trace_id=body["trace_id"],
                              trigger_time=body["trigger_time"], timeout_ms=1,
                              priority=body["priority"], retry_count=0, max_retry=0,
                              processor=None, callback_url=None,
                              dispatched_at=body["dispatched_at"], node=body["node"],
                              traceparent=body.get("traceparent"),
                              tracestate=body.get("tracestate"))
            except KeyError as exc:
                raise Rejected("missing_field", f"no field {exc}") from None
            return message._checked(SLIM_FIELDS + TRACE_FIELDS)
        if version != FULL_VERSION:
            raise Rejected("not_task", "not an ax task message (no \"v\": 1 or 2 object)")
        try:
            message = cls(**{k: body[k] for k in WIRE_FIELDS})
        except KeyError as exc:
            raise Rejected("missing_field", f"no field {exc}") from None
        return message._checked(WIRE_FIELDS)

    def _checked(self, fields: tuple[str, ...]) -> TaskMessage:
        """``self`` if each of ``fields`` is of its type and within its range."""
        message = self
        for name in _INT_FIELDS:
            if name not in fields:
                continue
            value = getattr(message, name)
            if type(value) is not int:
                raise Rejected("wrong_type", f"{name} is {type(value).__name__}, not int")
            low, high = _INT_RANGES[name]
            if not low <= value <= high:
                raise Rejected("bad_value", f"{name} {value} is outside [{low}, {high}]")
        for name, longest in _STR_FIELDS:
            if name not in fields:
                continue
            value = getattr(message, name)
            if value is None and name in _OPTIONAL:
                continue
            if type(value) is not str:
                raise Rejected("wrong_type", f"{name} is {type(value).__name__}, not str")
            if len(value) > longest:
                raise Rejected("bad_value", f"{name} is {len(value)} characters, over {longest}")
        if message.priority not in PRIORITIES:
            raise Rejected("bad_value", f"unknown priority {message.priority[:20]!r}")
        return message


class _NotSent:
    """The payload of a message that carried none (version 2): the row's is what runs."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NOT_SENT"


NOT_SENT: Any = _NotSent()
#: the optional trace context fields of a version-2 message
TRACE_FIELDS = ("traceparent", "tracestate")
#: the fields a version-1 message carries (the others come from the task row)
WIRE_FIELDS = tuple(f for f in TaskMessage._fields if f not in TRACE_FIELDS)
#: the fields a version-2 message carries
SLIM_FIELDS = ("task_id", "attempt", "trace_id", "trigger_time", "priority", "dispatched_at",
               "node")
_INT32, _INT64 = 2**31 - 1, 2**63 - 1
#: each integer field's allowed range (the task table's column types)
_INT_RANGES = {"task_id": (0, _INT64), "attempt": (1, _INT32), "trigger_time": (0, _INT64),
               "timeout_ms": (1, _INT32), "retry_count": (0, _INT32), "max_retry": (0, _INT32),
               "dispatched_at": (0, _INT64)}
_INT_FIELDS = tuple(_INT_RANGES)
#: each string field and its longest value (the task and node tables' columns)
_STR_FIELDS = (("task_type", 128), ("trace_id", 64), ("priority", 16), ("processor", 255),
               ("callback_url", 2048), ("node", 128), ("traceparent", 55),
               ("tracestate", 512))
_OPTIONAL = frozenset({"processor", "callback_url", *TRACE_FIELDS})


def redis_envelope(m: Sendable, queue: str) -> str:
    """The message as Kombu's Redis transport stores it (what ``Producer.publish`` would put)."""
    return (f'{{"body":{_encode_string(m.to_json())},"content-encoding":"utf-8",'
            f'"content-type":"application/json","headers":{_headers_json(m)},'
            f'"properties":{{"delivery_mode":2,"priority":0,"delivery_info":{{"exchange":"",'
            f'"routing_key":{_js(queue)}}},"delivery_tag":"{m.task_id}.{m.attempt}"}}}}')


def _headers_json(m: Sendable) -> str:
    """:func:`headers_of` as JSON text, built directly."""
    parent = getattr(m, "traceparent", None)
    if parent is None:
        return f'{{"trace_id":{_js(m.trace_id)}}}'
    state = getattr(m, "tracestate", None)
    more = "" if state is None else f',"tracestate":{_js(state)}'
    return f'{{"trace_id":{_js(m.trace_id)},"traceparent":{_js(parent)}{more}}}'
