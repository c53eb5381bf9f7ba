"""The Celery app of :mod:`bench.run`: one task, the shared body, run by a stock ``celery worker``.

    celery -A bench.celery_app worker -P threads -c 16 -Q <queue>

The worker's app is configured from ``AXBENCH_CELERY_BROKER`` (URL),
``AXBENCH_CELERY_PREFIX`` (a Redis key prefix: Kombu's ``global_keyprefix``) and
``AXBENCH_CELERY_QUEUE``; a producer makes its own with :func:`make_app`. No result
backend: results are ignored.
"""

from __future__ import annotations

import os

from celery import Celery

from . import ledger

TASK_NAME = "bench.ledger"


def body(i: int, due_ms: int) -> None:
    """The shared body (:func:`bench.ledger.record`)."""
    ledger.record(i, due_ms)


def make_app(broker: str, prefix: str = "", queue: str = "celery") -> Celery:
    """An app on ``broker`` (on Redis under key ``prefix``) whose default queue is ``queue``,
    with :func:`body` registered as ``bench.ledger``."""
    app = Celery("axbench", set_as_current=False)
    app.conf.update(broker_url=broker, task_default_queue=queue, task_ignore_result=True,
                    broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
                    broker_transport_options={"global_keyprefix": prefix} if prefix else {})
    app.task(name=TASK_NAME, shared=False)(body)
    return app


app = make_app(os.environ.get("AXBENCH_CELERY_BROKER", "memory://"),
               os.environ.get("AXBENCH_CELERY_PREFIX", ""),
               os.environ.get("AXBENCH_CELERY_QUEUE", "celery"))
