"""The processor the recurring-job end-to-end tests run in real ``ax-worker`` processes
(``-A tests.e2e.recurring_tasks``).

``e2e.tick``, whatever job it is an occurrence of, appends one JSON line per run to the
file named by the ``E2E_RECURRING_LEDGER`` variable, *before doing anything else*: the
job, the occurrence time (``scheduled_at``), the message's ``trigger_time`` (later than
``scheduled_at`` for a catch-up run after a misfire), task id, attempt, the start time
(``time.time()`` in epoch ms) and the pid. The test reads the file back to learn which
occurrences really ran, how often and how late.

Appends use ``O_APPEND`` and one ``write`` per line (well under ``PIPE_BUF``), so lines
from the pool threads, or from several worker processes, never interleave.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import ax_kombu as ax
from ax_kombu.worker.processors import Context

#: the variable naming the ledger file (not ``AX_*``: it is no setting of ax)
LEDGER_ENV = "E2E_RECURRING_LEDGER"


def record(path: str, ctx: Context) -> None:
    """Append this run to ``path``."""
    line = json.dumps({"job": ctx.job, "scheduled_at": ctx.scheduled_at,
                       "trigger_time": ctx.trigger_time, "task_id": ctx.task_id,
                       "attempt": ctx.attempt, "started_at": time.time_ns() // 1_000_000,
                       "pid": os.getpid()}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@ax.processor("e2e.tick")
def tick(payload: Any, ctx: Context) -> None:
    record(os.environ[LEDGER_ENV], ctx)
