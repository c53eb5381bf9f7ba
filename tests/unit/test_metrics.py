"""metrics.observe_many: the same exported samples as one observe() per value."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from ax_kombu.observability.metrics import observe_many

VALUES = [0.0, 0.0005, 0.001, 0.0011, 0.02, 0.02, 4.9, 5.0, 12.0, 1e9, -1.0]
BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 5.0, 10.0)


def exported(fill: Any, labels: bool) -> list[bytes]:
    """The text exposition of a fresh histogram after ``fill`` (creation times left out)."""
    registry = CollectorRegistry()
    hist = Histogram("h", "test", ["queue"] if labels else [], buckets=BUCKETS,
                     registry=registry)
    fill(hist.labels(queue="default") if labels else hist)
    return [line for line in generate_latest(registry).split(b"\n") if b"_created" not in line]


def one_by_one(hist: Any) -> None:
    for value in VALUES:
        hist.observe(value)


def test_observe_many_exports_what_observing_one_by_one_does() -> None:
    for labels in (False, True):
        assert exported(lambda h: observe_many(h, VALUES), labels) == exported(one_by_one, labels)


def test_observe_many_of_nothing_changes_nothing() -> None:
    assert exported(lambda h: observe_many(h, []), False) == exported(lambda h: None, False)


def test_observe_many_counts_every_value_once() -> None:
    registry = CollectorRegistry()
    hist = Histogram("h", "test", buckets=BUCKETS, registry=registry)
    observe_many(hist, VALUES)
    assert registry.get_sample_value("h_count") == len(VALUES)
    assert registry.get_sample_value("h_bucket", {"le": "0.001"}) == 4  # -1, 0, 0.0005, 0.001
    assert registry.get_sample_value("h_bucket", {"le": "0.02"}) == 7
    assert registry.get_sample_value("h_bucket", {"le": "+Inf"}) == len(VALUES)
    assert registry.get_sample_value("h_sum") == pytest.approx(sum(VALUES))


def test_observe_many_takes_the_batch_path_on_this_prometheus_client(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hist = Histogram("h", "test", buckets=BUCKETS, registry=CollectorRegistry())

    def refuse(value: float) -> None:
        raise AssertionError("observe() called once per value: the batch path was not taken")
    monkeypatch.setattr(hist, "observe", refuse)
    observe_many(hist, VALUES)
