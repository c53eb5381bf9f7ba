"""enqueue's input checks (pure: no store is touched)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from ax_kombu.config import from_env
from ax_kombu.core.fingerprint import canonical_json, fingerprint
from ax_kombu.exceptions import ValidationError
from ax_kombu.validation import build_row

SETTINGS = from_env({})
NOW = 1_800_000_000_000


def row(**kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = {"task_type": "t", "payload": {"a": 1}}
    args.update(kw)
    return build_row(SETTINGS, NOW, args.pop("task_type"), args.pop("payload"), **args)


@pytest.mark.parametrize("kw,message", [
    ({"task_type": ""}, "task_type"),
    ({"task_type": None}, "task_type"),
    ({"priority": "urgent"}, "unknown priority"),
    ({"run_at": datetime.now(UTC), "delay": 5}, "not both"),
    ({"run_at": datetime(2030, 1, 1)}, "naive"),
    ({"run_at": "2030-01-01"}, "must be a datetime"),
    ({"delay": -1}, ">= 0"),
    ({"delay": float("nan")}, "finite"),
    ({"delay": 1e308}, "too far ahead"),  # finite, but not once in ms
    ({"delay": "5s"}, "seconds or a timedelta"),
    ({"payload": {"x": object()}}, "JSON"),
    ({"payload": {"x": float("inf")}}, "JSON"),
    ({"payload": "x" * 70_000}, "limit"),
    ({"processor": "p", "callback_url": "http://127.0.0.1/x"}, "not both"),
    ({"callback_url": "ftp://x"}, "http"),
    ({"max_retry": -1}, "max_retry"),
    ({"max_retry": True}, "max_retry"),
    ({"timeout_ms": 0}, "timeout_ms"),
    ({"biz_key": ""}, "biz_key"),
])
def test_bad_input_is_a_clear_error(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        row(**kw)


def test_trigger_time_from_delay_run_at_or_now() -> None:
    assert row()["trigger_time"] == NOW
    assert row(delay=1.5)["trigger_time"] == NOW + 1500
    assert row(delay=timedelta(minutes=30))["trigger_time"] == NOW + 1_800_000
    at = datetime(2027, 1, 1, 20, 0, tzinfo=UTC)
    assert row(run_at=at)["trigger_time"] == round(at.timestamp() * 1000)


def test_fingerprint_ignores_key_order_but_not_values_or_type() -> None:
    a = canonical_json({"b": 1, "a": [1, {"y": 2, "x": 1}]}, 1000)
    b = canonical_json({"a": [1, {"x": 1, "y": 2}], "b": 1}, 1000)
    assert a == b
    assert fingerprint("t", a) == fingerprint("t", b)
    assert fingerprint("u", a) != fingerprint("t", a)
    assert fingerprint("t", canonical_json({"b": 2, "a": [1]}, 1000)) != fingerprint("t", a)


def test_target_is_exactly_one_of_processor_or_callback() -> None:
    assert (row()["processor_name"], row()["callback_url"]) == ("t", None)
    r = row(callback_url="https://127.0.0.1/hook")
    assert (r["processor_name"], r["callback_url"]) == (None, "https://127.0.0.1/hook")
