"""The ax worker's processor module for :mod:`bench.run` and :mod:`bench.backlog_alerts`
(``ax-worker -A bench.ax_tasks``)."""

from __future__ import annotations

import time
from typing import Any

import ax_kombu as ax

from . import ledger

TASK_TYPE = "bench.ledger"
SLEEP_TYPE = "bench.ledger_sleep"


@ax.processor(TASK_TYPE)
def body(payload: Any, ctx: Any) -> None:
    """The shared body (:func:`bench.ledger.record`); the payload is ``{"i": i, "due": due_ms}``."""
    ledger.record(payload["i"], payload["due"])


@ax.processor(SLEEP_TYPE)
def sleeper(payload: Any, ctx: Any) -> None:
    """The ledger line, then ``payload["ms"]`` ms of sleep (:mod:`bench.backlog_alerts`)."""
    ledger.record(payload["i"], payload["due"])
    time.sleep(payload["ms"] / 1000.0)
