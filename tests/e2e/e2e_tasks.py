"""Processors the end-to-end tests run in real ``ax-worker`` processes (``-A tests.e2e.e2e_tasks``).

One processor, ``e2e.task``, steered by its payload:

* ``log``: a file; every run appends one JSON line to it *before doing anything else*
  (task id, attempt, retry_count, the message's trigger time, start time in epoch ms, pid),
  so the test can count how many times each task really ran, and when;
* ``sleep``: seconds to sleep;
* ``fail``: the number of first runs that raise (``retry_count < fail``).

Appends use ``O_APPEND`` and one ``write`` per line (well under ``PIPE_BUF``), so
lines from several worker processes never interleave.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import ax_kombu as ax
from ax_kombu.worker.processors import Context


def record(path: str, ctx: Context) -> None:
    """Append this run to ``path``."""
    line = json.dumps({"id": ctx.task_id, "attempt": ctx.attempt, "retry": ctx.retry_count,
                       "trigger": ctx.trigger_time, "start": time.time_ns() // 1_000_000,
                       "pid": os.getpid()}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@ax.processor("e2e.task")
def task(payload: dict[str, Any], ctx: Context) -> None:
    if payload.get("log"):
        record(payload["log"], ctx)
    if ctx.retry_count < int(payload.get("fail", 0)):
        raise RuntimeError(f"planned failure #{ctx.retry_count + 1}")
    if payload.get("sleep"):
        time.sleep(float(payload["sleep"]))
