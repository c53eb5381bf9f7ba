"""The Celery app the Celery end-to-end test runs in an unmodified ``celery worker``
(``celery -A tests.e2e.celery_app worker``) and calls from the test process.

Configured by ``AX_TEST_CELERY_BROKER`` (URL), ``AX_TEST_CELERY_PREFIX`` (Redis key prefix,
the same as ax's), ``AX_TEST_CELERY_QUEUE`` and ``AX_TEST_CELERY_BOOTSTEP=1`` (add
``ax_kombu.celery.AxBootstep``) in the worker; the test calls :func:`configure` instead.
Its one task, ``e2e.celery.record``, appends one JSON line per run to the file named in its
arguments (task id, ax headers, worker, start time), with one ``O_APPEND`` write per line,
so the test can count runs and check when each started, then sleeps ``sleep`` seconds.
A worker of this app logs "ready." at WARNING once it consumes, so a test sees it whatever
the worker's log level (Celery's own "ready." line is at INFO).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from celery import Celery
from celery.signals import worker_ready

app = Celery("ax_e2e_celery", set_as_current=False)


def configure(broker: str, prefix: str = "", queue: str = "celery") -> None:
    """Point the app at ``broker`` (on Redis, under key ``prefix``), default queue ``queue``."""
    app.conf.update(broker_url=broker, task_default_queue=queue, task_ignore_result=True,
                    broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
                    broker_transport_options={"global_keyprefix": prefix} if prefix else {})


if os.environ.get("AX_TEST_CELERY_BROKER"):
    configure(os.environ["AX_TEST_CELERY_BROKER"], os.environ.get("AX_TEST_CELERY_PREFIX", ""),
              os.environ.get("AX_TEST_CELERY_QUEUE", "celery"))
if os.environ.get("AX_TEST_CELERY_BOOTSTEP") == "1":  # the worker fences and records in ax
    from ax_kombu.celery import AxBootstep

    app.steps["worker"].add(AxBootstep)


@app.task(name="e2e.celery.record", bind=True, shared=False)
def record(self: Any, log: str, i: int, sleep: float = 0.0) -> None:
    line = json.dumps({"i": i, "id": self.request.id, "ax": self.request.get("ax_task_id"),
                       "eta": self.request.eta, "worker": self.request.hostname,
                       "attempt": self.request.get("ax_attempt"),
                       "start": time.time_ns() // 1_000_000, "pid": os.getpid()}) + "\n"
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    time.sleep(sleep)


@worker_ready.connect
def _ready(**_: Any) -> None:
    logging.getLogger(__name__).warning("e2e worker ready.")
