"""The processors the pause end-to-end tests run in real ``ax-worker`` processes
(``-A tests.e2e.pause_tasks``): each records its run in the gate tests' ledger
(:func:`tests.e2e.gate_tasks.run`; the file named by ``E2E_GATES_LEDGER``)."""

from __future__ import annotations

import ax_kombu as ax

from .gate_tasks import run

#: the task types the pause tests use
TASK_TYPES = ("pause.held", "pause.other", "pause.queued")

for _task_type in TASK_TYPES:
    ax.processor(_task_type)(run)
