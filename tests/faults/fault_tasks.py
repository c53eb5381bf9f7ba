"""The processor the fault scenarios run in real ``ax-worker`` processes
(``-A tests.faults.fault_tasks``): ``fault.task`` writes the **ledger**.

Every run appends its start and end lines (:mod:`tests.ledger`) to the file named by
``FAULT_LEDGER`` (set by :class:`tests.faults.cluster.Cluster` in each daemon's
environment), with the producer's planned trigger time (payload ``t``) and the node name
(``FAULT_NODE``). The payload's ``sleep`` (seconds) is the run's work. Only
``ax_kombu.processor`` (public) is imported from ax.
"""

from __future__ import annotations

import os
import time
from typing import Any

import ax_kombu as ax
from tests.ledger import recording

LEDGER = os.environ.get("FAULT_LEDGER", "")
NODE = os.environ.get("FAULT_NODE", "")


@ax.processor("fault.task")
def task(payload: dict[str, Any], ctx: Any) -> None:
    if not LEDGER:
        return
    with recording(LEDGER, ctx, planned=payload.get("t"), node=NODE):
        if payload.get("sleep"):
            time.sleep(float(payload["sleep"]))
