"""A claimed row becomes its message by column name (to_message), and the wire format."""

from __future__ import annotations

import dataclasses
import json
from collections import namedtuple
from typing import Any

import pytest

from ax_kombu.broker.celery_wire import CeleryBound, CeleryFenced
from ax_kombu.broker.messages import (
    NOT_SENT,
    SLIM_FIELDS,
    WIRE_FIELDS,
    ClaimedTask,
    RawJson,
    TaskMessage,
    redis_envelope,
)
from ax_kombu.broker.rejects import Rejected
from ax_kombu.scheduler.dispatcher import to_message
from ax_kombu.store.claims import _CLAIM_COLUMNS
from tests.wire import version_1_json

#: a claimed row as the claim returns it: its columns by name
ClaimedRow = namedtuple("ClaimedRow", [c.strip() for c in _CLAIM_COLUMNS.split(",")])  # type: ignore[misc]


def _row(*values: Any, target_node: str | None = None, runner: str = "ax",
         traceparent: str | None = None, tracestate: str | None = None) -> Any:
    return ClaimedRow._make((*values, target_node, runner, traceparent, tracestate))


def test_claim_columns_are_what_the_message_needs() -> None:
    columns = [c.strip() for c in _CLAIM_COLUMNS.split(",")]
    fields = [field.name for field in dataclasses.fields(ClaimedTask)][:12]
    renamed = {"processor_name": "processor"}
    assert [renamed.get(c, c) for c in columns[:12]] == fields
    # routing only, not in the message; then the trace context (in the message when set)
    assert columns[12:] == ["target_node", "runner", "traceparent", "tracestate"]


def test_the_trace_context_travels_in_the_body_and_the_headers() -> None:
    values = (5, 2, "t", "{}", "tr", 100, 500, "high", 1, 3, "p", None)
    parent = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    message = to_message(_row(*values, traceparent=parent, tracestate="k=v"), "node-1", 123)
    body = json.loads(message.to_json())
    assert (body["traceparent"], body["tracestate"]) == (parent, "k=v")
    received = TaskMessage.from_body(body)
    assert (received.traceparent, received.tracestate) == (parent, "k=v")
    headers = json.loads(redis_envelope(message, "q"))["headers"]
    assert headers == {"trace_id": "tr", "traceparent": parent, "tracestate": "k=v"}
    with pytest.raises(Rejected, match="traceparent"):
        TaskMessage.from_body({**body, "traceparent": 7})
    assert "traceparent" not in json.loads(to_message(_row(*values), "n", 1).to_json())


def test_to_message_and_json_round_trip() -> None:
    values = (5, 2, "t", '{"a":[1,"x"]}', "tr", 100, 500, "high", 1, 3, None,
              "http://127.0.0.1/x")
    message = to_message(_row(*values, runner="callback"), "node-1", 123)
    assert message.route is None
    assert to_message(_row(*values, target_node="w7"), "node-1", 123).route == "ax.worker.w7"
    assert type(to_message(_row(*values, runner="callback"), "node-1", 123)) is ClaimedTask
    assert type(to_message(_row(*values, runner="celery"), "node-1", 123)) is CeleryBound
    fenced = to_message(_row(*values, target_node="w7", runner="celery_ax"), "node-1", 123)
    assert type(fenced) is CeleryFenced and fenced.fenced and fenced.route == "ax.worker.w7"
    assert isinstance(message.payload, RawJson)
    sent = TaskMessage(**{name: getattr(message, name) for name in WIRE_FIELDS})
    full = json.loads(version_1_json(sent))  # version 1, as an older scheduler sent it
    assert full["payload"] == {"a": [1, "x"]} and full["callback_url"] == "http://127.0.0.1/x"
    assert TaskMessage.from_body(full) == sent._replace(payload={"a": [1, "x"]})
    assert not TaskMessage.from_body(full).slim
    body = json.loads(message.to_json())  # version 2: only what the row cannot say
    assert body == {"v": 2, "task_id": 5, "attempt": 2, "trigger_time": 100, "priority": "high",
                    "trace_id": "tr", "dispatched_at": 123, "node": "node-1"}
    slim = TaskMessage.from_body(body)
    assert slim.slim and slim.payload is NOT_SENT and slim.callback_url is None
    assert {f: getattr(slim, f) for f in SLIM_FIELDS} == {f: getattr(message, f)
                                                          for f in SLIM_FIELDS}
    envelope = json.loads(redis_envelope(message, "q"))
    assert json.loads(envelope["body"]) == body
    assert envelope["properties"]["delivery_info"]["routing_key"] == "q"
    assert envelope["properties"]["delivery_tag"] == "5.2"
