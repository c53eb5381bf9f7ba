"""Pauses without a database: names are checked (a type: any valid type name; a queue: one
of the configured names), stored rows resolve to this node's priorities, a lifted pause is
noticed, and nothing paused adds no SQL at all."""

from __future__ import annotations

import pytest

from ax_kombu.config import PRIORITIES
from ax_kombu.exceptions import ValidationError
from ax_kombu.store import pauses
from ax_kombu.store.pauses import NONE, Paused

QUEUES = ("high.x", "default.x", "slow.x")


def queue_for(priority: str) -> str:
    return f"{priority}.x"


@pytest.mark.parametrize("name", ["sms.send", "a", "x" * 128, "émoji ✓"])
def test_any_valid_type_name_may_be_paused(name: str) -> None:
    assert pauses.check("type", name, QUEUES) == name


@pytest.mark.parametrize("name", ["", "   ", "x" * 129, None, 3, "bad\udcff"])
def test_an_invalid_type_name_is_refused(name: object) -> None:
    with pytest.raises(ValidationError, match="task_type"):
        pauses.check("type", name, QUEUES)


def test_a_queue_is_named_as_configured() -> None:
    assert pauses.check("queue", "slow.x", QUEUES) == "slow.x"


@pytest.mark.parametrize("name", ["slow", "nope", "", None])
def test_an_unknown_queue_is_refused_with_the_configured_names(name: object) -> None:
    with pytest.raises(ValidationError, match=r"unknown queue .*high\.x, default\.x, slow\.x"):
        pauses.check("queue", name, QUEUES)


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ValidationError, match="kind must be one of type, queue"):
        pauses.check("worker", "w1", QUEUES)


def test_rows_resolve_to_types_and_this_nodes_priorities() -> None:
    rows = [("type", "sms.send"), ("queue", "slow.x"), ("queue", "gone.queue")]
    paused = pauses.resolve(rows, queue_for, PRIORITIES)
    assert paused == Paused(frozenset({"sms.send"}), frozenset({"slow"}))
    assert paused.params() == {"paused_types": ["sms.send"], "paused_priorities": ["slow"]}


def test_a_queue_this_node_does_not_use_pauses_nothing() -> None:
    paused = pauses.resolve([("queue", "other")], queue_for, PRIORITIES)
    assert not paused.any
    assert paused.params() == {}


def test_lifting_any_pause_is_noticed_and_adding_one_is_not() -> None:
    both = Paused(frozenset({"a", "b"}), frozenset({"slow"}))
    assert Paused(frozenset({"a"}), frozenset({"slow"})).lifted_since(both)
    assert Paused(frozenset({"a", "b"})).lifted_since(both)
    assert not both.lifted_since(Paused(frozenset({"a"})))
    assert not both.lifted_since(both)
    assert not NONE.lifted_since(NONE)


def test_nothing_paused_adds_no_sql() -> None:
    assert pauses.task_filter(NONE) == ""
    assert pauses.due_filter(NONE, "ax_due.task_id") == ""


def test_the_filters_name_only_what_is_paused() -> None:
    types = Paused(frozenset({"a"}))
    assert pauses.task_filter(types, "t.") == " AND NOT t.task_type IN :paused_types"
    queues = Paused(priorities=frozenset({"slow"}))
    assert pauses.task_filter(queues) == " AND NOT priority IN :paused_priorities"
    assert "p.task_type IN :paused_types OR p.priority IN :paused_priorities" in \
        pauses.due_filter(Paused(frozenset({"a"}), frozenset({"slow"})), "c.task_id")
