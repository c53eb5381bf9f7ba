"""The processors the gate end-to-end tests run in real ``ax-worker`` processes
(``-A tests.e2e.gate_tasks``).

Every task type here runs :func:`run`: it sleeps ``payload["sleep"]`` seconds, or with
``payload["wait"]`` waits that long on ``ctx.cancelled`` (returning early when the run is
cancelled or superseded), then appends one JSON line to the file named by the
``E2E_GATES_LEDGER`` variable: task id, type, payload, job, occurrence time, shard,
attempt, start and end (``time.time()``, seconds), pid, the worker's name (from
``E2E_GATES_NODE``, else the pid) and whether ``ctx.cancelled`` was set at the end (and
why). The test reads the file back to learn what really ran, when, where and for how long.

Appends use ``O_APPEND`` and one ``write`` per line (well under ``PIPE_BUF``), so lines
from the pool threads, or from the two worker processes, never interleave.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import ax_kombu as ax
from ax_kombu.worker.processors import Context

#: the variable naming the ledger file (not ``AX_*``: it is no setting of ax)
LEDGER_ENV = "E2E_GATES_LEDGER"
#: the variable naming the worker process (its ``-n``)
NODE_ENV = "E2E_GATES_NODE"
#: every task type the gate tests use; each runs :func:`run`
TASK_TYPES = ("e2e.ordered", "e2e.limited", "e2e.serial", "e2e.discard", "e2e.cover",
              "e2e.shard", "e2e.broadcast", "e2e.broadcast_orphan")


def record(path: str, payload: Any, ctx: Context, start: float, end: float) -> None:
    """Append this run to ``path``."""
    line = json.dumps({
        "task_id": ctx.task_id, "task_type": ctx.task_type, "payload": payload,
        "job": ctx.job, "scheduled_at": ctx.scheduled_at, "attempt": ctx.attempt,
        "shard_index": ctx.shard_index, "shard_total": ctx.shard_total,
        "start": start, "end": end, "pid": os.getpid(),
        "node": os.environ.get(NODE_ENV) or str(os.getpid()),
        "cancelled": bool(ctx.cancelled),
        "cancel_reason": ctx.cancelled.reason if ctx.cancelled is not None else None,
    }) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def run(payload: Any, ctx: Context) -> None:
    """Sleep or wait as the payload says, then record the run."""
    start = time.time()
    spec = payload if isinstance(payload, dict) else {}
    if "wait" in spec and ctx.cancelled is not None:
        ctx.cancelled.wait(float(spec["wait"]))
    else:
        time.sleep(float(spec.get("sleep", 0)))
    record(os.environ[LEDGER_ENV], payload, ctx, start, time.time())


for _task_type in TASK_TYPES:
    ax.processor(_task_type)(run)
