"""How the worker's periodic cancel check reads (worker/housekeeping.by_window): by
trigger-time window for a burst's many runs due close together, by id otherwise."""

from __future__ import annotations

import pytest

from ax_kombu.worker.housekeeping import WINDOW_FROM_RUNS, WINDOW_MAX_MS, by_window


@pytest.mark.parametrize(("runs", "span_ms", "window"), [
    (WINDOW_FROM_RUNS, 0, True),                 # a burst: all due at one instant
    (5000, WINDOW_MAX_MS, True),                 # due over a minute
    (5000, WINDOW_MAX_MS + 1, False),            # a backlog's late runs beside new ones
    (WINDOW_FROM_RUNS - 1, 0, False),            # few runs: their ids are cheaper
    (1, 3_600_000, False),
])
def test_the_cancel_check_reads_the_window_only_for_many_runs_due_close_together(
        runs: int, span_ms: int, window: bool) -> None:
    at = 1_800_000_000_000
    assert by_window(runs, at, at + span_ms) is window
