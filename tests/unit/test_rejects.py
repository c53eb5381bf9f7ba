"""What a worker refuses before a message reaches the database (ax_kombu.broker.rejects)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ax_kombu.broker import rejects
from ax_kombu.broker.messages import TaskMessage
from ax_kombu.broker.rejects import Rejected
from tests.wire import version_1, version_1_json

GOOD = TaskMessage(task_id=5, attempt=2, task_type="t", payload={"a": [1, "x"]}, trace_id="tr",
                   trigger_time=100, timeout_ms=500, priority="high", retry_count=1,
                   max_retry=3, processor=None, callback_url="http://h/x", dispatched_at=7,
                   node="n")


def body(**changes: Any) -> dict[str, Any]:
    value = version_1(GOOD)  # version 1: every field
    value.update(changes)
    return value


def reason(call: Any) -> str:
    with pytest.raises(Rejected) as caught:
        call()
    assert isinstance(caught.value, ValueError)
    return caught.value.reason


def test_a_good_body_parses_and_extra_keys_are_ignored() -> None:
    assert TaskMessage.from_body(body(extra=1)) == GOOD


@pytest.mark.parametrize(("value", "expected"), [
    ([1], "not_task"), ({"task_id": 5}, "not_task"), (body(v=3), "not_task"),
    ({"v": 1, "task_id": 5}, "missing_field"),
    (body(attempt="2"), "wrong_type"), (body(attempt=True), "wrong_type"),
    (body(timeout_ms=500.0), "wrong_type"), (body(task_type=None), "wrong_type"),
    (body(node=3), "wrong_type"), (body(processor=["x"]), "wrong_type"),
    (body(attempt=0), "bad_value"), (body(task_id=-1), "bad_value"),
    (body(task_id=2**63), "bad_value"), (body(retry_count=-1), "bad_value"),
    (body(priority="urgent"), "bad_value"), (body(task_type="t" * 129), "bad_value"),
    (body(callback_url="u" * 2049), "bad_value"),
])
def test_from_body_is_strict(value: Any, expected: str) -> None:
    assert reason(lambda: TaskMessage.from_body(value)) == expected


def slim(**changes: Any) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(GOOD.to_json())  # version 2: what the row cannot say
    value.update(changes)
    return value


def test_a_version_2_body_parses_to_its_fields_only() -> None:
    message = TaskMessage.from_body(slim(extra=1))
    assert message.slim and (message.task_id, message.attempt, message.trigger_time,
                             message.priority, message.trace_id, message.dispatched_at,
                             message.node) == (5, 2, 100, "high", "tr", 7, "n")


@pytest.mark.parametrize(("value", "expected"), [
    ({"v": 2, "task_id": 5}, "missing_field"), (slim(attempt="2"), "wrong_type"),
    (slim(trigger_time=1.5), "wrong_type"), (slim(trace_id=None), "wrong_type"),
    (slim(attempt=0), "bad_value"), (slim(task_id=2**63), "bad_value"),
    (slim(priority="urgent"), "bad_value"), (slim(node="n" * 129), "bad_value"),
])
def test_a_version_2_body_is_as_strict(value: Any, expected: str) -> None:
    assert reason(lambda: TaskMessage.from_body(value)) == expected


def test_decode_body_keeps_every_integer_exact() -> None:
    """orjson decodes what ax publishes; a body where it would differ (an integer over 64
    bits turns into a float there) is decoded by the standard decoder."""
    assert decode('{"v":2,"task_id":18446744073709551616}')["task_id"] == 2**64
    assert decode('{"v":1,"payload":{"n":123456789012345678901234567890}}')["payload"] \
        == {"n": 123456789012345678901234567890}
    assert reason(lambda: TaskMessage.from_body(decode(json.dumps(slim(task_id=2**64))))) \
        == "bad_value"


def decode(raw: bytes | str, content_type: str | None = "application/json",
           encoding: str | None = "utf-8", headers: dict[str, Any] | None = None,
           limit: int = rejects.MIN_BODY_LIMIT) -> Any:
    return rejects.decode_body(raw, content_type, encoding, headers, limit)


def test_decode_body_takes_plain_json_only() -> None:
    assert decode(version_1_json(GOOD)) == body()
    assert decode(version_1_json(GOOD).encode(), encoding=None) == body()
    assert decode(GOOD.to_json()) == slim()
    assert reason(lambda: decode(b"\x80\x03}q", "application/x-python-serialize",
                                 "binary")) == "content_type"
    assert reason(lambda: decode("a: 1", "application/x-yaml")) == "content_type"
    assert reason(lambda: decode("{}", encoding="latin-1")) == "content_type"
    assert reason(lambda: decode("{}", headers={"compression": "application/x-gzip"})) \
        == "content_type"
    assert reason(lambda: decode("{not json")) == "not_json"
    assert reason(lambda: decode(b"\xff\xfe\xfa")) == "not_json"


def test_size_is_judged_before_anything_else() -> None:
    assert rejects.body_limit(65536) == rejects.MIN_BODY_LIMIT
    assert rejects.body_limit(1 << 20) == 4 << 20
    assert reason(lambda: decode(b"x" * 101, "application/x-python-serialize",
                                 limit=100)) == "too_large"


def test_nesting_and_breadth_are_bounded() -> None:
    nest = "[" * 100_000 + "]" * 100_000
    assert reason(lambda: decode(nest)) == "too_deep"
    deep = json.dumps(body(payload=None))[:-1] + ', "payload": ' + "[" * 70 + "]" * 70 + "}"
    assert reason(lambda: decode(deep)) == "too_deep"
    fine = json.dumps(body(payload=None))[:-1] + ', "payload": ' + "[" * 60 + "]" * 60 + "}"
    assert decode(fine)["payload"]
    wide = json.dumps(body(payload=[[0] * 1000] * 101))
    assert reason(lambda: decode(wide)) == "too_large"
    assert decode(json.dumps(body(payload=[[0] * 1000] * 99)))["v"] == 1
