"""The ax worker's processor module for :mod:`bench.run` (``ax-worker -A bench.ax_tasks``)."""

from __future__ import annotations

from typing import Any

import ax_kombu as ax

from . import ledger

TASK_TYPE = "bench.ledger"


@ax.processor(TASK_TYPE)
def body(payload: Any, ctx: Any) -> None:
    """The shared body (:func:`bench.ledger.record`); the payload is ``{"i": i, "due": due_ms}``."""
    ledger.record(payload["i"], payload["due"])
