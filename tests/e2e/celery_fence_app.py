"""The Celery app of :mod:`tests.e2e.test_celery_fence`: a worker with the AxBootstep.

Run as ``celery -A tests.e2e.celery_fence_app worker`` and configured like
:mod:`tests.e2e.celery_app` (``AX_TEST_CELERY_BROKER``, ``AX_TEST_CELERY_PREFIX``,
``AX_TEST_CELERY_QUEUE``), with the ``AX_*`` variables the bootstep reads. Its one task,
``fence.run``, appends one JSON line per run to the ledger file named in its arguments (the
ax task id and attempt, the Celery id, the pid of the process running it, the start time),
with one ``O_APPEND`` write, then sleeps ``first_sleep`` seconds on the first attempt only
(so a test can kill or revoke that run while it is under way; a retry ends at once).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from celery import Celery
from celery.signals import worker_ready

from ax_kombu.celery import AxBootstep

app = Celery("ax_fence_celery", set_as_current=False)
app.steps["worker"].add(AxBootstep)


def configure(broker: str, prefix: str = "", queue: str = "celery") -> None:
    """Point the app at ``broker`` (on Redis, under key ``prefix``), default queue ``queue``."""
    app.conf.update(broker_url=broker, task_default_queue=queue, task_ignore_result=True,
                    broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
                    worker_prefetch_multiplier=1,
                    broker_transport_options={"global_keyprefix": prefix} if prefix else {})


configure(os.environ.get("AX_TEST_CELERY_BROKER", "memory://"),
          os.environ.get("AX_TEST_CELERY_PREFIX", ""),
          os.environ.get("AX_TEST_CELERY_QUEUE", "celery"))


@app.task(name="fence.run", bind=True, shared=False)
def run(self: Any, log: str, i: int, first_sleep: float = 0.0) -> int:
    attempt = self.request.get("ax_attempt")
    line = json.dumps({"i": i, "id": self.request.id, "ax": self.request.get("ax_task_id"),
                       "attempt": attempt, "pid": os.getpid(),
                       "eta": self.request.eta and str(self.request.eta),
                       "start": time.time_ns() // 1_000_000}) + "\n"
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    if attempt == 1:
        time.sleep(first_sleep)
    return i


@worker_ready.connect
def _ready(**_: Any) -> None:
    logging.getLogger(__name__).warning("fence worker ready.")
