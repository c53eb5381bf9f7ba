"""Validation at the edge, as properties: arbitrary arguments to ``enqueue`` / ``enqueue_many``
(strings of any length and alphabet, huge and negative numbers, bools, NaN and infinities,
nested payloads, None, wrong types) either create a task that reads back as given and fits
every column, or raise :class:`ValidationError` and write nothing.

SQLite does not enforce VARCHAR lengths or 32-bit INTEGERs, so a created task is also
checked against the column sizes of :mod:`ax_kombu.store.schema` — what PostgreSQL would
refuse with a database error. The explicit cases at the end run on both stores.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sqlalchemy import BigInteger, Integer, String, func, select

from ax_kombu.api import Client, TaskView
from ax_kombu.config import PRIORITIES, Settings, from_env
from ax_kombu.core.fingerprint import MAX_PAYLOAD_DEPTH, MAX_PAYLOAD_VALUES
from ax_kombu.core.values import (
    MAX_CALLBACK_URL,
    MAX_HORIZON_MS,
    MAX_PROCESSOR,
    MAX_RETRY,
    MAX_TIMEOUT_MS,
)
from ax_kombu.exceptions import ValidationError
from ax_kombu.store.schema import tasks

PROPERTY = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.data_too_large])
COLUMNS = {"task_type": "task_type", "processor_name": "processor_name",
           "callback_url": "callback_url", "biz_key": "biz_key", "trace_id": "trace_id",
           "priority": "priority"}
INT32 = (-(1 << 31), (1 << 31) - 1)
INT64 = (-(1 << 63), (1 << 63) - 1)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Client]:
    """A producer on a SQLite file (fast): the properties are about validation, not SQL."""
    client = Client(from_env({}, database_url=f"sqlite:///{tmp_path / 'ax.sqlite3'}",
                             auto_migrate=True,
                             broker_url=f"ax+sqlite:///{tmp_path / 'broker.sqlite3'}"))
    yield client
    client.close()


def _count(client: Client) -> int:
    with client.store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(tasks)).scalar_one())


# -- strategies ------------------------------------------------------------------------------

def _lengths(near: int) -> st.SearchStrategy[str]:
    """Strings just under, at and over a column's size."""
    return st.integers(near - 2, near + 2).map(lambda n: "x" * max(n, 0))


def _mostly(valid: st.SearchStrategy[Any], *invalid: st.SearchStrategy[Any]
            ) -> st.SearchStrategy[Any]:
    """``valid`` nine times in ten: so most examples reach the later fields' checks."""
    bad = st.one_of(*invalid)
    return st.sampled_from([True] * 9 + [False]).flatmap(lambda ok: valid if ok else bad)


CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
NAME = st.text(CHARS, min_size=1, max_size=40).filter(str.strip)
TEXT = st.one_of(st.text(max_size=40), st.text(min_size=100, max_size=300),
                 st.sampled_from(["", " ", "\x00", "a\x00b", "\ud800", "é" * 129, "\n"]))
NUMBER = st.one_of(st.integers(), st.integers(-5, 5), st.integers(min_value=1 << 60),
                   st.floats(), st.booleans())
ANY = st.one_of(st.none(), TEXT, NUMBER, st.binary(max_size=8), st.lists(st.integers(),
                                                                         max_size=2))
URL = st.builds(lambda scheme, host, path, query: f"{scheme}://{host}{path}{query}",
                st.sampled_from(["http", "https", "HTTP", "ftp", "javascript", ""]),
                st.sampled_from(["example.com", "127.0.0.1", "[::1]", "", "h:99999", "h:x",
                                 "[", "u:p@h"]),
                st.one_of(st.just("/cb"), st.text(max_size=10).map(lambda s: "/" + s),
                          st.integers(2030, 2060).map(lambda n: "/" + "p" * n)),
                st.sampled_from(["", "?token=s3cr3t", "?a=1&b=2"]))
GOOD_URL = st.builds(lambda scheme, host, path: f"{scheme}://{host}/{path}",
                     st.sampled_from(["http", "https"]),
                     st.sampled_from(["example.com", "127.0.0.1:8080", "[::1]"]),
                     st.text(st.characters(whitelist_categories=("L", "N")), max_size=30))
JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
                      st.floats(allow_nan=False, allow_infinity=False), st.text(CHARS,
                                                                                max_size=20))
GOOD_PAYLOAD = st.recursive(JSON_LEAF, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.text(CHARS, max_size=8), kids, max_size=4)),
    max_leaves=20)
BAD_LEAF = st.one_of(st.integers(min_value=1 << 64, max_value=1 << 70), st.floats(),
                     st.sampled_from(["\ud800", object(), {1, 2}, b"bytes"]))
PAYLOAD = _mostly(
    GOOD_PAYLOAD,
    st.recursive(st.one_of(JSON_LEAF, BAD_LEAF), lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.tuples(kids, kids),
        st.dictionaries(st.text(max_size=8), kids, max_size=4),
        st.dictionaries(st.one_of(st.integers(), st.none(), st.booleans()), kids, max_size=2)),
        max_leaves=20),
    st.integers(MAX_PAYLOAD_DEPTH - 3, MAX_PAYLOAD_DEPTH + 3).map(lambda depth: _nested(depth)),
    st.integers(65_500, 65_600).map(lambda n: "y" * n),
)
ZONES = st.sampled_from([None, UTC, timezone(timedelta(hours=14)),
                         timezone(-timedelta(hours=12))])
WHEN = _mostly(st.datetimes(min_value=datetime(2020, 1, 1), max_value=datetime(2035, 1, 1),
                            timezones=st.sampled_from([UTC, timezone(timedelta(hours=5))])),
               st.datetimes(timezones=ZONES), TEXT, NUMBER)
DELAY = _mostly(st.one_of(st.floats(0, 1e6), st.integers(0, 10 ** 6), st.timedeltas(
                    min_value=timedelta(0), max_value=timedelta(days=3000))),
                NUMBER, st.timedeltas(), st.floats(3e8, 4e8),
                st.integers(MAX_HORIZON_MS // 1000 - 10, MAX_HORIZON_MS // 1000 + 10), TEXT)

OPTIONS = st.fixed_dictionaries({}, optional={
    "run_at": WHEN,
    "delay": DELAY,
    "priority": _mostly(st.sampled_from(PRIORITIES), ANY),
    "biz_key": _mostly(NAME, TEXT, _lengths(255), ANY),
    "max_retry": _mostly(st.integers(0, MAX_RETRY), st.integers(-2, 0), st.integers(MAX_RETRY,
                                                                                 MAX_RETRY + 2),
                         ANY),
    "timeout_ms": _mostly(st.integers(1, MAX_TIMEOUT_MS), st.integers(-2, 1),
                          st.integers(MAX_TIMEOUT_MS - 2, MAX_TIMEOUT_MS + 2), ANY),
    "processor": _mostly(NAME, TEXT, _lengths(MAX_PROCESSOR), ANY),
    "callback_url": _mostly(GOOD_URL, URL,
                            _lengths(MAX_CALLBACK_URL).map(lambda s: "http://h/" + s), ANY),
    "trace_id": _mostly(st.from_regex(r"[A-Za-z0-9._:-]{1,32}", fullmatch=True), TEXT,
                        st.from_regex(r"[A-Za-z0-9._:-]{30,40}", fullmatch=True),
                        _lengths(32), ANY),
})
TASK_TYPE = _mostly(NAME, _lengths(128), TEXT, ANY)


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


# -- the oracle ------------------------------------------------------------------------------

def _fits_columns(view: TaskView) -> None:
    """What PostgreSQL would check: every string within its column, every integer within
    its column's type."""
    for column in tasks.columns:
        value = getattr(view, column.name, None)
        if value is None or column.name in ("status", "payload"):
            continue
        if isinstance(column.type, String) and column.type.length:
            assert isinstance(value, str) and len(value) <= column.type.length, column.name
            assert "\x00" not in value, column.name
            value.encode()  # valid UTF-8
        elif isinstance(column.type, BigInteger):
            assert INT64[0] <= value <= INT64[1], column.name
        elif isinstance(column.type, Integer):
            assert INT32[0] <= value <= INT32[1], column.name


def _check_created(client: Client, task_id: int, args: dict[str, Any], now: int) -> None:
    view = client.get(task_id)
    _fits_columns(view)
    if not task_id.created:  # type: ignore[attr-defined]
        return  # a duplicate (biz_key or fingerprint): the stored task is an earlier one
    assert view.task_type == args["task_type"]
    assert view.priority == args.get("priority", "default")
    assert view.payload == json.loads(json.dumps(args.get("payload")))
    if args.get("callback_url") is not None:
        assert view.callback_url == args["callback_url"]
        assert view.callback_url.lower().startswith(("http://", "https://"))
    else:
        assert view.processor_name == (args.get("processor") or args["task_type"])
    if args.get("trace_id") is not None:
        assert view.trace_id == args["trace_id"]
    if args.get("biz_key") is not None:
        assert view.biz_key == args["biz_key"]
    assert 0 <= view.max_retry <= MAX_RETRY
    assert 1 <= view.timeout_ms <= MAX_TIMEOUT_MS
    assert 0 <= view.trigger_time <= now + MAX_HORIZON_MS + 60_000


@PROPERTY
@given(task_type=TASK_TYPE, payload=PAYLOAD, options=OPTIONS)
def test_enqueue_creates_a_valid_task_or_refuses_and_writes_nothing(
        client: Client, task_type: Any, payload: Any, options: dict[str, Any]) -> None:
    before = _count(client)
    now = client.store.now_ms()
    try:
        task_id = client.enqueue(task_type, payload, **options)
    except ValidationError as exc:
        event(f"refused: {str(exc)[:60]}")
        assert _count(client) == before
        return
    event("accepted")
    _check_created(client, task_id, {"task_type": task_type, "payload": payload, **options}, now)
    assert _count(client) == before + (1 if task_id.created else 0)


ITEM = st.builds(lambda task_type, payload, options: {"task_type": task_type,
                                                      "payload": payload, **options},
                 TASK_TYPE, PAYLOAD, OPTIONS)


@PROPERTY
@given(items=st.one_of(st.lists(ITEM, max_size=4),
                       st.lists(st.one_of(ITEM, ANY, st.just({"task_type": "t", "bogus": 1}),
                                          st.just({1: "t"})), max_size=3),
                       ANY))
def test_enqueue_many_creates_every_task_or_none(client: Client, items: Any) -> None:
    before = _count(client)
    now = client.store.now_ms()
    try:
        ids = client.enqueue_many(items)
    except ValidationError as exc:
        event(f"refused: {str(exc)[:60]}")
        assert _count(client) == before
        return
    event("accepted")
    for task_id, item in zip(ids, items, strict=True):
        _check_created(client, task_id, item, now)
    assert _count(client) == before + sum(1 for i in ids if i.created)


# -- explicit cases: on both stores (PostgreSQL checks what SQLite does not) -----------------

@pytest.mark.parametrize("options", [
    {"processor": "p" * (MAX_PROCESSOR + 1)},
    {"callback_url": "https://example.com/" + "c" * MAX_CALLBACK_URL},
    {"callback_url": "https://example.com/c b"},
    {"callback_url": "http://h:99999/"},
    {"callback_url": "mailto:x@example.com"},
    {"task_type": "t" * 129},
    {"task_type": "a\x00b"},
    {"biz_key": "b" * 256},
    {"trace_id": "t" * 33},
    {"trace_id": "has space"},
    {"priority": ["high"]},
    {"max_retry": MAX_RETRY + 1},
    {"max_retry": 2.0},
    {"timeout_ms": MAX_TIMEOUT_MS + 1},
    {"timeout_ms": 1 << 40},
    {"delay": 1e300},
    {"delay": 10 ** 400},
    {"delay": timedelta.max},
    {"run_at": datetime(9999, 1, 1, tzinfo=UTC)},
    {"run_at": datetime(1, 1, 2, tzinfo=UTC)},
    {"payload": {"n": 1 << 64}},
    {"payload": {1: "x"}},
    {"payload": "\ud800"},
    {"payload": _nested(MAX_PAYLOAD_DEPTH + 1)},
    {"payload": [0] * MAX_PAYLOAD_VALUES},
])
def test_each_bound_is_a_validation_error_on_every_store(settings: Settings,
                                                          options: dict[str, Any]) -> None:
    client = Client(settings)
    try:
        before = _count(client)
        args = {"task_type": "bounded", "payload": {"a": 1}, **options}
        with pytest.raises(ValidationError):
            client.enqueue(args.pop("task_type"), args.pop("payload"), **args)
        assert _count(client) == before
    finally:
        client.close()


def test_the_largest_valid_values_are_stored_on_every_store(settings: Settings) -> None:
    client = Client(settings)
    try:
        deepest = {"n": (1 << 63) - 1, "deep": _nested(MAX_PAYLOAD_DEPTH - 1)}
        task_id = client.enqueue("t" * 128, deepest,
                                 biz_key="b" * 255, trace_id="T" * 32, max_retry=MAX_RETRY,
                                 timeout_ms=MAX_TIMEOUT_MS, delay=MAX_HORIZON_MS // 1000 - 60,
                                 callback_url="https://example.com/" + "c" * 2028)
        view = client.get(task_id)
        assert len(view.callback_url or "") == MAX_CALLBACK_URL
        assert view.timeout_ms == MAX_TIMEOUT_MS
        other = client.enqueue("p", None, processor="p" * MAX_PROCESSOR)
        assert client.get(other).processor_name == "p" * MAX_PROCESSOR
    finally:
        client.close()
