"""The wire format: one JSON message per task attempt, readable by a plain Kombu consumer.

A message says which task and which attempt is due; the attempt is the fencing
token a worker checks against the row. The trace id also travels in the headers.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring as _encode_string
from typing import Any, NamedTuple

MESSAGE_VERSION = 1


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

    def body(self) -> dict[str, Any]:
        """The body as a dict (what a consumer receives after JSON decoding)."""
        body: dict[str, Any] = json.loads(self.to_json())
        return body

    def to_json(self) -> str:
        """The JSON body, built directly (the payload is spliced in if it is RawJson)."""
        payload = self.payload if isinstance(self.payload, RawJson) else json.dumps(
            self.payload, separators=(",", ":"), ensure_ascii=False)
        return (f'{{"v":{MESSAGE_VERSION},"task_id":{self.task_id:d},"attempt":{self.attempt:d},'
                f'"task_type":{_js(self.task_type)},"payload":{payload},'
                f'"trace_id":{_js(self.trace_id)},"trigger_time":{self.trigger_time:d},'
                f'"timeout_ms":{self.timeout_ms:d},"priority":{_js(self.priority)},'
                f'"retry_count":{self.retry_count:d},"max_retry":{self.max_retry:d},'
                f'"processor":{_js(self.processor)},"callback_url":{_js(self.callback_url)},'
                f'"dispatched_at":{self.dispatched_at:d},"node":{_js(self.node)}}}')

    @classmethod
    def from_body(cls, body: Any) -> TaskMessage:
        """Parse a received body.

        Raises:
            ValueError: the body is not an ax task message.
        """
        if not isinstance(body, dict) or body.get("v") != MESSAGE_VERSION:
            raise ValueError("not an ax task message")
        try:
            return cls._make([body[k] for k in cls._fields])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed ax task message: {exc}") from None


def redis_envelope(m: TaskMessage, queue: str) -> str:
    """The message as Kombu's Redis transport stores it (what ``Producer.publish`` would put)."""
    return (f'{{"body":{_encode_string(m.to_json())},"content-encoding":"utf-8",'
            f'"content-type":"application/json","headers":{{"trace_id":{_js(m.trace_id)}}},'
            f'"properties":{{"delivery_mode":2,"priority":0,"delivery_info":{{"exchange":"",'
            f'"routing_key":{_js(queue)}}},"delivery_tag":"{m.task_id}.{m.attempt}"}}}}')
