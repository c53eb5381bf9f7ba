"""The processor the fault scenarios run in real ``ax-worker`` processes
(``-A tests.faults.fault_tasks``): ``fault.task`` writes the **ledger**.

Every run appends two JSON lines to the file named by ``FAULT_LEDGER`` (set
by :class:`tests.faults.cluster.Cluster` in each daemon's environment):

* ``{"ev": "start", ...}`` *before doing anything else*: task id, attempt,
  retry_count, the message's trigger time, the producer's planned trigger
  time (payload ``t``), the node name (``FAULT_NODE``), pid, start epoch ms;
* ``{"ev": "end", ...}`` when the processor body returns (never written by a
  process killed mid-run, so "started, never ended" marks a run cut short).

The payload's ``sleep`` (seconds) is the run's work. Appends use ``O_APPEND``
and one ``write`` per line (far below ``PIPE_BUF``), so lines of several
processes and threads never interleave. Only ``ax_kombu.processor`` (public)
is imported from ax.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import ax_kombu as ax

LEDGER = os.environ.get("FAULT_LEDGER", "")
NODE = os.environ.get("FAULT_NODE", "")
PID = os.getpid()


def _append(record: dict[str, Any]) -> None:
    if not LEDGER:
        return
    fd = os.open(LEDGER, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())
    finally:
        os.close(fd)


@ax.processor("fault.task")
def task(payload: dict[str, Any], ctx: Any) -> None:
    run = {"id": ctx.task_id, "attempt": ctx.attempt, "pid": PID}
    _append({"ev": "start", **run, "retry": ctx.retry_count, "trigger": ctx.trigger_time,
             "planned": payload.get("t"), "node": NODE, "t": time.time_ns() // 1_000_000})
    if payload.get("sleep"):
        time.sleep(float(payload["sleep"]))
    _append({"ev": "end", **run, "t": time.time_ns() // 1_000_000})
