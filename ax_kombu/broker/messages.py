"""The wire format: one JSON message per task attempt, readable by a plain Kombu consumer.

A message says which task and which attempt is due; the attempt is the fencing
token a worker checks against the row. The trace id also travels in the headers.

Version 2 (what ax publishes) carries only what the row cannot tell the worker
before it fences the task: ``task_id``, ``attempt``, ``trigger_time``,
``priority``, ``trace_id``, and who dispatched it when (``dispatched_at``,
``node``)::

    {"v":2,"task_id":7,"attempt":1,"trigger_time":1764892800000,"priority":"default",
     "trace_id":"…","dispatched_at":1764892799750,"node":"scheduler@host"}

No payload, processor or callback URL crosses the broker: the worker's RUNNING
move returns them from the row, and that is what runs. Version 1 (every field
of the row's task, payload included) is still accepted, so messages published
by an older scheduler run after an upgrade (upgrade workers first).
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring as _encode_string
from typing import Any, NamedTuple

from ax_kombu.broker.rejects import Rejected
from ax_kombu.config import PRIORITIES

MESSAGE_VERSION = 2
#: the full message of earlier versions (payload and all), still accepted
FULL_VERSION = 1


class RawJson(str):
    """A payload that is already JSON text (as stored in the task row): sent as is."""


def _js(value: str | None) -> str:
    return "null" if value is None else _encode_string(value)


class TaskMessage(NamedTuple):
    """What a worker receives for one attempt of one task (a NamedTuple: the scheduler
    builds tens of thousands a second, and a tuple is several times cheaper to make)."""

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
    # Not on the wire, and never set by the scheduler: a worker's run reads its task from
    # the row its start returned (ax_kombu.worker.task.RunTask); a test may hand a message
    # where a run's task is read.
    #: the recurring job this task is an occurrence of (None: a one-off task)
    job: str | None = None
    #: that occurrence's time, epoch ms
    scheduled_at: int | None = None
    #: claimed by the gated claim (its end wakes the next of its key or type)
    gated: bool = False
    order_key: str | None = None
    shard_index: int | None = None
    shard_total: int | None = None
    #: the queue to publish to when not the priority's (a worker's own queue)
    route: str | None = None
    #: when the worker's start of this attempt was written (DB clock)
    started_at: int | None = None

    def body(self) -> dict[str, Any]:
        """The body as a dict (what a consumer receives after JSON decoding)."""
        body: dict[str, Any] = json.loads(self.to_json())
        return body

    def to_json(self) -> str:
        """The JSON body (version 2: no payload; see the module docstring), built directly."""
        return (f'{{"v":{MESSAGE_VERSION},"task_id":{self.task_id:d},"attempt":{self.attempt:d},'
                f'"trigger_time":{self.trigger_time:d},"priority":{_js(self.priority)},'
                f'"trace_id":{_js(self.trace_id)},"dispatched_at":{self.dispatched_at:d},'
                f'"node":{_js(self.node)}}}')

    @property
    def slim(self) -> bool:
        """Received as a version-2 message: only :data:`SLIM_FIELDS` came from the wire."""
        return self.payload is NOT_SENT

    def full_json(self) -> str:
        """The version-1 body, every field with the payload (spliced in if RawJson): what
        an older scheduler published, and what a test forging one sends."""
        payload = self.payload if isinstance(self.payload, RawJson) else json.dumps(
            self.payload, separators=(",", ":"), ensure_ascii=False)
        return (f'{{"v":{FULL_VERSION},"task_id":{self.task_id:d},"attempt":{self.attempt:d},'
                f'"task_type":{_js(self.task_type)},"payload":{payload},'
                f'"trace_id":{_js(self.trace_id)},"trigger_time":{self.trigger_time:d},'
                f'"timeout_ms":{self.timeout_ms:d},"priority":{_js(self.priority)},'
                f'"retry_count":{self.retry_count:d},"max_retry":{self.max_retry:d},'
                f'"processor":{_js(self.processor)},"callback_url":{_js(self.callback_url)},'
                f'"dispatched_at":{self.dispatched_at:d},"node":{_js(self.node)}}}')

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
                message = cls(body["task_id"], body["attempt"], "", NOT_SENT, body["trace_id"],
                              body["trigger_time"], 1, body["priority"], 0, 0, None, None,
                              body["dispatched_at"], body["node"])
            except KeyError as exc:
                raise Rejected("missing_field", f"no field {exc}") from None
            return message._checked(SLIM_FIELDS)
        if version != FULL_VERSION:
            raise Rejected("not_task", "not an ax task message (no \"v\": 1 or 2 object)")
        try:
            message = cls(*[body[k] for k in WIRE_FIELDS])
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
#: the fields a version-1 message carries (the others come from the task row)
WIRE_FIELDS = TaskMessage._fields[:14]
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
               ("callback_url", 2048), ("node", 128))
_OPTIONAL = frozenset({"processor", "callback_url"})


def redis_envelope(m: TaskMessage, queue: str) -> str:
    """The message as Kombu's Redis transport stores it (what ``Producer.publish`` would put)."""
    return (f'{{"body":{_encode_string(m.to_json())},"content-encoding":"utf-8",'
            f'"content-type":"application/json","headers":{{"trace_id":{_js(m.trace_id)}}},'
            f'"properties":{{"delivery_mode":2,"priority":0,"delivery_info":{{"exchange":"",'
            f'"routing_key":{_js(queue)}}},"delivery_tag":"{m.task_id}.{m.attempt}"}}}}')
