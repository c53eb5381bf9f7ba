"""The figures of ``python -m bench run`` from a ledger, without servers (bench/run.py,
bench/report.py)."""

from __future__ import annotations

from bench.ledger import Entry
from bench.report import ratios, table
from bench.run import due_times, summarise, timeline


def test_due_times_burst_and_spread() -> None:
    assert due_times("burst", 3, 1000, 500.0) == [1000, 1000, 1000]
    assert due_times("spread", 4, 1000, 500.0) == [1000, 1002, 1004, 1006]
    assert due_times("backlog", 2, 1000, 500.0) == [1000, 1000]  # all due at the hand-over


def test_summary_counts_first_runs_and_ignores_the_warm_up() -> None:
    dues = [10_000] * 4
    entries = [Entry(-1, 9_000, 9_001.0), Entry(0, 10_000, 10_002.5), Entry(1, 10_000, 10_150.0),
               Entry(1, 10_000, 10_400.0), Entry(2, 10_000, 9_999.5)]
    out = summarise(entries, dues)
    assert (out["ran"], out["missing"], out["duplicates"], out["early"]) == (3, 1, 1, 1)
    assert out["first_ms"] == -0.5
    assert out["max_ms"] == 150.0
    assert out["lateness_ms"] == [-0.5, 2.5, 150.0]
    assert out["timeline"] == {"start_s": -0.1, "counts": [1, 1, 1]}


def test_timeline_buckets_of_100_ms_from_the_first_due_time() -> None:
    assert timeline([1_000.0, 1_050.0, 1_250.0], 1_000) == {"start_s": 0.0, "counts": [2, 0, 1]}


def test_ratios_are_other_over_ax_within_a_repeat() -> None:
    results = [{"system": "ax", "repeat": 0, "p50_ms": 2.0, "p99_ms": 10.0, "max_ms": 20.0,
                "first_ms": 1.0, "late_handover": False},
               {"system": "celery", "repeat": 0, "p50_ms": 9.0, "p99_ms": 45.0, "max_ms": 40.0,
                "first_ms": 0.0, "late_handover": True}]
    assert ratios(results) == [{"repeat": 0, "system": "celery", "p50_ms": 4.5, "p99_ms": 4.5,
                                "max_ms": 2.0, "first_ms": 0.0}]
    assert "(late!)" in table(results).splitlines()[-1]
