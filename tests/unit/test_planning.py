"""Capacity planning (ax_kombu.core.planning): the arithmetic, rounding up, validation."""

from __future__ import annotations

import math
from typing import Any

import pytest

from ax_kombu.core.planning import Plan, percentile, plan, validate
from ax_kombu.exceptions import ValidationError


def test_the_articles_example() -> None:
    assert plan(2000, 200) == Plan(peak_rate=2000, avg_ms=200, threads_per_node=100,
                                   per_thread_rate=5.0, threads=400, nodes=4,
                                   queue_length=80_000)


@pytest.mark.parametrize(("rate", "avg_ms", "per_node", "threads", "nodes"), [
    (2001, 200, 100, 401, 5),      # 400.2 threads: one more thread, and a node for it
    (2000, 200, 400, 400, 1),      # exactly full
    (2000, 200, 399, 400, 2),
    (1, 1, 100, 1, 1),             # 0.001 busy threads still need one
    (0.5, 10, 100, 1, 1),
    (3, 100, 100, 1, 1),           # 0.3 → 1
    (10, 110, 1, 2, 2),            # 1.1 → 2
    (0.3, 10_000, 1, 3, 3),        # 3.0 stays 3
    (0.7, 1000, 100, 1, 1),
    (100_000, 2.5, 64, 250, 4),
])
def test_threads_and_nodes_round_up(rate: float, avg_ms: float, per_node: int, threads: int,
                                    nodes: int) -> None:
    result = plan(rate, avg_ms, per_node)
    assert (result.threads, result.nodes) == (threads, nodes)
    assert result.queue_length == threads * 200
    assert result.per_thread_rate == pytest.approx(1000 / avg_ms)
    assert result.threads >= rate / result.per_thread_rate - 1e-9  # enough to keep up


def test_float_noise_does_not_buy_a_thread() -> None:
    assert 0.1 * 3 * 1000 != 300  # 300.00000000000006
    assert plan(0.1 * 3, 1000).threads == 1
    assert plan(0.1 * 3 * 1000, 1000, 100).threads == 300
    assert plan(0.1 * 3 * 1000, 1000, 100).nodes == 3


@pytest.mark.parametrize(("args", "named"), [
    ((-1, 200), "peak_rate"),
    ((0, 200), "peak_rate"),
    ((math.nan, 200), "peak_rate"),
    ((math.inf, 200), "peak_rate"),
    ((2000, 0), "avg_ms"),
    ((2000, -5.0), "avg_ms"),
    ((2000, math.inf), "avg_ms"),
    ((2000, "200"), "avg_ms"),
    ((2000, True), "avg_ms"),
    ((2000, 200, 0), "threads_per_node"),
    ((2000, 200, -3), "threads_per_node"),
    ((2000, 200, 2.5), "threads_per_node"),
    ((2000, 200, True), "threads_per_node"),
])
def test_invalid_input_names_the_argument(args: tuple[Any, ...], named: str) -> None:
    with pytest.raises(ValidationError, match=named):
        plan(*args)


def test_validate_checks_avg_ms_only_when_given() -> None:
    validate(10)
    validate(10, None, 5)
    with pytest.raises(ValidationError, match="peak_rate"):
        validate(-1)
    with pytest.raises(ValidationError, match="avg_ms"):
        validate(10, 0)


def test_validation_error_is_a_value_error_and_exit_2() -> None:
    with pytest.raises(ValueError) as caught:
        plan(-1, 1)
    assert isinstance(caught.value, ValidationError) and caught.value.exit_code == 2


def test_percentile_by_nearest_rank() -> None:
    assert percentile([100, 200, 300], 50) == 200
    assert percentile([100, 200, 300, 400], 50) == 200
    assert percentile(list(range(1, 101)), 99) == 99
    assert percentile(list(range(1, 101)), 100) == 100
    assert percentile(list(range(1, 1001)), 99) == 990
    assert percentile([7], 1) == percentile([7], 99) == 7
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1], 0)
